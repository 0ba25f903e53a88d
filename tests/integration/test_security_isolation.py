"""Security through the real Envoy: tenants never see each other's prefix history, prompts never
reach the logs or the decision log, and the image runs as non-root.

Covered elsewhere: debug endpoints are off by default (test_scheduling_envoy.py), TLS on the
ext_proc port (test_extproc_tls.py), a client's own destination header never steers the pick
(test_reliability_inputs.py).
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.stack import start_envoy, start_picker

ROOT = Path(__file__).resolve().parents[2]
# Long enough for many prefix blocks; distinctive enough to grep for.
SECRET = "zebra-quartz-7731"
SHARED_PROMPT = " ".join(f"{SECRET} paragraph {i} of the shared confidential system prompt" for i in range(150))


def post(url: str, body: bytes, headers: dict[str, str] | None = None, path: str = "/v1/completions") -> int:
    req = urllib.request.Request(url + path, data=body, headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        e.read()
        return e.code


def latest_prefix_scores(metrics_port: int) -> dict[str, float]:
    """The prefix-cache-scorer's score per endpoint in the newest decision."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/debug/decisions", timeout=5) as r:
        decision = json.loads(r.read())["decisions"][0]
    profile = decision["profiles"][decision["primary_profile"]]
    return {c["endpoint"]: c["scores"]["prefix-cache-scorer"] for c in profile["candidates"]}


@pytest.mark.parametrize("scope", ["tenant-header", "cache_salt"])
def test_tenant_b_is_not_steered_by_tenant_a_history(backends, log_dir: Path, scope: str) -> None:
    addresses, _ = backends
    picker = start_picker(
        log_dir,
        "--endpoints",
        ",".join(addresses),
        "--tenant-header",
        "x-tenant",
        "--enable-debug-decisions",
        name=f"picker-tenants-{scope}",
    )
    envoy = start_envoy("duplex", picker.grpc_port, log_dir, name=f"envoy-tenants-{scope}")

    def send(tenant: str) -> dict[str, float]:
        if scope == "tenant-header":
            body, headers = {"model": "m", "prompt": SHARED_PROMPT}, {"x-tenant": tenant}
        else:
            body, headers = {"model": "m", "prompt": SHARED_PROMPT, "cache_salt": f"salt-{tenant}"}, {}
        assert post(envoy.url, json.dumps(body).encode(), headers) == 200
        return latest_prefix_scores(picker.metrics_port)

    try:
        assert set(send("a").values()) == {0.0}  # first sight of the prompt
        a_again = send("a")
        assert max(a_again.values()) > 0.9  # tenant A's history pulls A back to its pod
        b_first = send("b")
        assert set(b_first.values()) == {0.0}, b_first  # the same prompt, another tenant: no history
        assert max(send("b").values()) > 0.9  # B builds its own
        with urllib.request.urlopen(f"http://127.0.0.1:{picker.metrics_port}/debug/decisions", timeout=5) as r:
            assert SECRET not in r.read().decode()  # decisions explain scores, never prompts
    finally:
        envoy.stop()
        picker.stop()


def test_no_prompt_text_in_the_log_at_the_default_level(backends, log_dir: Path) -> None:
    addresses, _ = backends
    picker = start_picker(
        log_dir,
        "--endpoints",
        ",".join(addresses),
        "--max-body-bytes",
        str(64 << 10),
        "--tenant-header",
        "x-tenant",
        name="picker-log-privacy",
    )
    envoy = start_envoy("duplex", picker.grpc_port, log_dir, name="envoy-log-privacy")
    try:
        requests = [
            (json.dumps({"model": "m", "prompt": SHARED_PROMPT}).encode(), "/v1/completions", 200),
            (json.dumps({"model": "m", "prompt": SHARED_PROMPT, "stream": True}).encode(), "/v1/completions", 200),
            (
                json.dumps({"model": "m", "messages": [{"role": "user", "content": SHARED_PROMPT}]}).encode(),
                "/v1/chat/completions",
                200,
            ),
            (b'{"model": "m", "prompt": "' + SECRET.encode() + b'"', "/v1/completions", 400),  # truncated JSON
            (json.dumps({"model": "m", "prompt": 5, "note": SECRET}).encode(), "/v1/completions", 400),
            (json.dumps({"model": SECRET, "messages": SECRET}).encode(), "/v1/chat/completions", 400),
            (b'{"model": "m", "prompt": "' + SECRET.encode() + b'\xff"}', "/v1/completions", 400),
            (json.dumps({"model": "m", "prompt": SHARED_PROMPT * 30}).encode(), "/v1/completions", 413),
            (json.dumps({"model": "m", "prompt": SECRET, "extra": [[[]]]}).encode(), "/v1/responses", 400),
        ]
        for body, path, status in requests:
            assert post(envoy.url, body, {"x-tenant": SECRET}, path) == status
        text = picker.process.log_path.read_text(errors="replace")
        assert "picker serving ext_proc" in text  # the log is the picker's, and it was written to
    finally:
        envoy.stop()
        picker.stop()
    assert SECRET not in picker.process.log_path.read_text(errors="replace")


def test_the_image_runs_as_a_non_root_user() -> None:
    stages = re.split(r"(?im)^FROM\s", (ROOT / "Dockerfile").read_text())
    final = stages[-1]
    users = re.findall(r"(?im)^USER\s+(\S+)", final)
    assert users, "the final stage sets no USER"
    user = users[-1].split(":")[0]
    assert user not in ("0", "root")
