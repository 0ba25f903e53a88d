"""`picker bbr` against the reference `bbr` v1.5.0 (`~/.cache/picker/bin/bbr-v1.5.0`, built from
the same Go module as the reference EPP): the reference's own BBR cases (its handler and plugin
tests: model in the body, none, empty, not a string, a large body, streamed answers, a body that
is not JSON, a LoRA adapter mapped to its base model through a labelled ConfigMap) sent through
Envoy to each, in FULL_DUPLEX_STREAMED mode (the reference chart's, `--streaming`) and in
BUFFERED mode, to the same echoing model server. Compared: the status, the routing headers the
model server received, and the body it received (byte for byte)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator

import pytest

from picker.bbr.plugins import BASE_MODEL_HEADER, MODEL_HEADER
from picker_bench.bbr import PICKER_BBR, bbr_envoy_config, reference_bbr_binary, start_bbr, start_envoy
from picker_bench.gobuild import GoModuleUnavailableError
from picker_bench.process import free_port, wait_until
from tests.e2e.bbr_stack import ADAPTER, BASE_MODEL, Answer, post, put_adapter_config_map
from tests.e2e.kube_resources import create_namespace
from tests.stack import loopback_addresses, start_backends

ROUTING_HEADERS = (MODEL_HEADER.lower(), BASE_MODEL_HEADER.lower())


def completion(**fields: object) -> bytes:
    return json.dumps({**fields, "prompt": "Tell me a joke"}).encode()


# (case, request body): the reference's cases (pkg/bbr/handlers/request_test.go,
# plugins/*/..._test.go) and what its JSON decoding makes of other values.
CASES: list[tuple[str, bytes | None]] = [
    ("success", completion(model="foo")),
    ("model not found", completion()),
    ("model in body but empty", completion(model="")),
    ("model is not a string", completion(model=1)),
    ("model is a boolean", completion(model=True)),
    ("model is null", completion(model=None)),
    ("model is a large number", completion(model=1.5e21)),
    ("model is a big integer", completion(model=12345678901234567890)),
    ("model is a million", completion(model=1000000)),
    ("model is a six-digit fraction", completion(model=123456.7)),
    ("model is a fraction", completion(model=0.00001)),
    ("model is a list", completion(model=["a", 2])),
    ("base model maps to itself", completion(model=BASE_MODEL)),
    ("lora adapter maps to base model", completion(model=ADAPTER)),
    ("unknown model", completion(model="unknown-model")),
    ("large body", json.dumps({"model": "foo", "prompt": "a" * 70000}).encode()),
    ("streamed answer", json.dumps({"model": ADAPTER, "stream": True, "prompt": "hi"}).encode()),
    ("json null", b"null"),
    ("bad json", b'{"model": "foo",'),
    ("json array", b'["model"]'),
    ("json string", b'"model"'),
    ("no body", None),
]


@pytest.fixture(scope="module")
def routers(kube_cluster, admin_api, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[tuple[str, str], str]]:
    """(router, mode) → the completions URL of an Envoy in front of it, one echoing backend behind."""
    try:
        reference = str(reference_bbr_binary())  # built from its Go module the first time
    except GoModuleUnavailableError as exc:
        pytest.fail(str(exc), pytrace=False)
    log_dir = tmp_path_factory.mktemp("bbr-reference")
    namespace = create_namespace(admin_api, "bbr")
    put_adapter_config_map(admin_api, namespace, "qwen-adapters", BASE_MODEL, [ADAPTER])
    (backend,) = loopback_addresses(1)
    host, port = backend.rsplit(":", 1)
    processes = [start_backends([backend], log_dir)]
    urls: dict[tuple[str, str], str] = {}
    try:
        for mode in ("duplex", "buffered"):
            for label, command in (("reference", (reference,)), ("picker", PICKER_BBR)):
                name = f"{label}-{mode}"
                grpc_port = free_port()
                processes.append(
                    start_bbr(
                        command, kube_cluster.admin_kubeconfig, grpc_port, log_dir, name, streaming=mode == "duplex"
                    )
                )
                config = bbr_envoy_config(
                    mode,
                    ("127.0.0.1", free_port()),
                    ("127.0.0.1", grpc_port),
                    (host, int(port)),
                    ("127.0.0.1", free_port()),
                )
                envoy = start_envoy(config, log_dir, f"envoy-{name}")
                processes.append(envoy)
                url = envoy.url + "/v1/completions"
                # The adapter ConfigMap is watched: each router follows it within the deadline.
                wait_until(
                    lambda url=url: (
                        post(url, completion(model=ADAPTER)).upstream_header(ROUTING_HEADERS[1]) == BASE_MODEL
                    ),
                    timeout=30,
                    what=f"{name} to map the adapter",
                    interval=0.2,
                )
                urls[(label, mode)] = url
        yield urls
    finally:
        for process in reversed(processes):
            process.stop()


def seen(answer: Answer) -> dict[str, object]:
    """What a case is compared on: status, the routing headers and body the model server got."""
    echoed = answer.echoed()
    if answer.status != 200 or echoed is None:
        return {
            "status": answer.status,
            "body": hashlib.sha256(answer.body).hexdigest() if answer.status == 200 else None,
        }
    return {
        "status": answer.status,
        **{name: answer.upstream_header(name) for name in ROUTING_HEADERS},
        "received body": echoed["body_sha256"],
    }


@pytest.mark.parametrize("mode", ["duplex", "buffered"])
@pytest.mark.parametrize(("case", "body"), CASES, ids=[case for case, _ in CASES])
def test_picker_bbr_sets_the_headers_the_reference_sets(routers, mode: str, case: str, body: bytes | None) -> None:
    method = "GET" if body is None else "POST"
    reference = post(routers[("reference", mode)], body, method)
    picker = post(routers[("picker", mode)], body, method)
    assert seen(picker) == seen(reference), case
    if reference.status == 400:
        # picker's error body is OpenAI-style JSON (the reference's is Go's error text)
        assert json.loads(picker.body)["error"]["code"] == "BadRequest"
