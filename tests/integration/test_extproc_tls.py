"""TLS on the ext_proc port: self-signed by default, a certificate directory reloaded on change,
and plaintext when `--secure-serving=false`."""

from __future__ import annotations

import json
import os
import socket
import ssl
import urllib.request
from pathlib import Path

from cryptography import x509
from cryptography.x509.oid import NameOID

from picker.extproc.tls import self_signed_certificate
from picker_bench.process import wait_until
from tests.stack import start_envoy, start_picker


def served_common_name(port: int) -> str:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, context.wrap_socket(raw) as tls:
        assert tls.selected_alpn_protocol() == "h2"
        cert = x509.load_der_x509_certificate(tls.getpeercert(binary_form=True))
    return cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value


def write_certificate(directory: Path, name: str) -> None:
    key, cert = self_signed_certificate(name)
    for filename, data in (("tls.key", key), ("tls.crt", cert)):
        staged = directory / f".{filename}.new"
        staged.write_bytes(data)
        os.replace(staged, directory / filename)  # atomic, as a Secret volume update is


def route_once(envoy_url: str) -> dict:
    req = urllib.request.Request(
        envoy_url + "/v1/completions",
        data=json.dumps({"model": "m", "prompt": "x"}).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read())


def test_certificate_directory_is_served_and_reloaded(backends, log_dir: Path, tmp_path: Path) -> None:
    addresses, _ = backends
    write_certificate(tmp_path, "first")
    picker = start_picker(
        log_dir, "--endpoints", ",".join(addresses), "--cert-path", str(tmp_path), name="picker-certs"
    )
    envoy = start_envoy("duplex", picker.grpc_port, log_dir, name="envoy-certs")
    try:
        assert served_common_name(picker.grpc_port) == "first"
        assert route_once(envoy.url)["backend"] in addresses
        write_certificate(tmp_path, "second")
        wait_until(lambda: served_common_name(picker.grpc_port) == "second", 10, "the new certificate")
        assert route_once(envoy.url)["backend"] in addresses
    finally:
        envoy.stop()
        picker.stop()


def test_default_is_a_self_signed_certificate(backends, log_dir: Path) -> None:
    addresses, _ = backends
    picker = start_picker(log_dir, "--endpoints", ",".join(addresses), name="picker-selfsigned")
    try:
        assert served_common_name(picker.grpc_port) == "picker"
    finally:
        picker.stop()


def test_plaintext_when_secure_serving_is_false(backends, log_dir: Path) -> None:
    addresses, _ = backends
    picker = start_picker(log_dir, "--endpoints", ",".join(addresses), name="picker-plain", tls=False)
    envoy = start_envoy("duplex", picker.grpc_port, log_dir, tls=False, name="envoy-plain")
    try:
        assert route_once(envoy.url)["backend"] in addresses
    finally:
        envoy.stop()
        picker.stop()
