"""`picker serve` with the reference's flags, through real clients: gRPC health as the
reference chart probes it, --health-checking on the ext_proc port, and the model-server metrics
flags scraping a trtllm-serve-like page on another port."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from picker.telemetry.health import EXT_PROC_SERVICE
from picker_bench.metric_pages import trtllm_page
from picker_bench.process import ManagedProcess, free_port, port_open, wait_until
from picker_bench.soak import scrape
from tests.stack import health_status, loopback_addresses, start_picker

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# What the reference chart probes (inference-extension with one replica, liveness/readiness
# with several), what load balancers ask ("") and the service itself.
PROBED = ("inference-extension", "liveness", "readiness", "", EXT_PROC_SERVICE)
# Unlabelled endpoints read as trtllm-serve.
TRTLLM_CONFIG = """apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: metrics-data-source
- {type: core-metrics-extractor, parameters: {defaultEngine: trtllm-serve}}
dataLayer:
  sources: [{pluginRef: metrics-data-source, extractors: [{pluginRef: core-metrics-extractor}]}]
"""


def statuses(port: int, names: tuple[str, ...] = PROBED) -> dict[str, int]:
    return {name: health_status(port, name) for name in names}


def test_health_answers_every_name_the_reference_chart_probes(log_dir: Path) -> None:
    (address,) = loopback_addresses(1)
    picker = start_picker(
        log_dir, "--endpoints", address, "--health-checking", "--shutdown-delay", "30s", name="picker-health", tls=False
    )
    try:
        assert statuses(picker.health_port, (*PROBED, "any-other-name")) == dict.fromkeys((*PROBED, "any-other-name"), SERVING)  # fmt: skip
        with grpc.insecure_channel(f"127.0.0.1:{picker.health_port}") as channel:
            listed = health_pb2_grpc.HealthStub(channel).List(health_pb2.HealthListRequest(), timeout=2)
        assert dict(listed.statuses) == {EXT_PROC_SERVICE: health_pb2.HealthCheckResponse(status=SERVING)}
        # --health-checking: the standard health service on the ext_proc port, as the reference.
        assert statuses(picker.grpc_port, ("", EXT_PROC_SERVICE)) == {"": SERVING, EXT_PROC_SERVICE: SERVING}
        with pytest.raises(grpc.RpcError) as unknown:
            health_status(picker.grpc_port, "inference-extension")
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        os.kill(picker.process.pid, signal.SIGTERM)  # draining: every name but liveness goes
        wait_until(lambda: health_status(picker.health_port, "readiness") == NOT_SERVING, 5, "draining")
        assert statuses(picker.health_port) == {**dict.fromkeys(PROBED, NOT_SERVING), "liveness": SERVING}
        assert statuses(picker.grpc_port, ("", EXT_PROC_SERVICE)) == {"": NOT_SERVING, EXT_PROC_SERVICE: NOT_SERVING}
    finally:
        picker.stop()


def test_health_is_not_serving_for_every_name_until_the_pool_has_synced(log_dir: Path, tmp_path: Path) -> None:
    """Without leader election the reference answers every name, liveness included, from the
    pool's sync: an unreachable Kubernetes API leaves them all NOT_SERVING."""
    unreachable = free_port()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: x\n"
        f"clusters: [{{name: c, cluster: {{server: 'http://127.0.0.1:{unreachable}'}}}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: x, context: {cluster: c, user: u}}]\n"
    )
    health = free_port()
    argv = [sys.executable, "-m", "picker.cli", "serve", "--bind-address", "127.0.0.1", "--secure-serving=false",
            "--grpc-port", str(free_port()), "--grpc-health-port", str(health), "--metrics-port", str(free_port()),
            "--pool-name", "pool", "--kubeconfig", str(kubeconfig)]  # fmt: skip
    with ManagedProcess("picker-unsynced", argv, log_dir) as picker:
        picker.wait_ready(lambda: port_open("127.0.0.1", health), timeout=30)
        assert statuses(health) == dict.fromkeys(PROBED, NOT_SERVING)


class TrtllmServe(ThreadingHTTPServer):
    """trtllm-serve's metrics: `/prometheus/metrics` on a port of its own; counts every path asked."""

    daemon_threads = True

    def __init__(self, host: str, waiting: int) -> None:
        page = trtllm_page(waiting=waiting)
        paths: Counter[str] = Counter()
        self.paths = paths

        class Handler(BaseHTTPRequestHandler):
            disable_nagle_algorithm = True

            def do_GET(self) -> None:
                paths[self.path] += 1
                found = self.path == "/prometheus/metrics"
                self.send_response(200 if found else 404)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(page) if found else 0))
                self.end_headers()
                if found:
                    self.wfile.write(page)

            def log_message(self, *args: object) -> None:
                pass

        super().__init__((host, 0), Handler)


@pytest.fixture()
def trtllm_serve() -> Iterator[TrtllmServe]:
    host = loopback_addresses(1)[0].rsplit(":", 1)[0]
    server = TrtllmServe(host, waiting=7)
    thread = threading.Thread(target=server.serve_forever, name="trtllm-serve", daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_model_server_metrics_flags_scrape_a_trtllm_serve_page_on_another_port(
    trtllm_serve: TrtllmServe, log_dir: Path, tmp_path: Path
) -> None:
    host, metrics_port = trtllm_serve.server_address[:2]
    inference_port = free_port(str(host))  # where requests would go; nothing needs to listen
    endpoint = f"{host}:{inference_port}"
    endpoints = tmp_path / "endpoints.yaml"
    endpoints.write_text(
        f"- address: {endpoint}\n  labels: {{inference.networking.k8s.io/engine-type: trtllm-serve}}\n"
    )
    picker = start_picker(
        log_dir,
        "--endpoints-file", str(endpoints),
        "--model-server-metrics-path", "/prometheus/metrics",
        "--model-server-metrics-port", str(metrics_port),
        "--model-server-metrics-scheme", "http",
        "--refresh-prometheus-metrics-interval", "50ms",
        name="picker-trtllm",
    )  # fmt: skip
    try:
        queue = f'inference_pool_per_pod_queue_size{{model_server_pod="{endpoint}",name=""}}'
        wait_until(lambda: scrape(picker.metrics_port).get(queue) == 7, 10, "the trtllm page's queue in the picker")
        # It keeps scraping that page, on that path only.
        scraped = trtllm_serve.paths.total()
        wait_until(lambda: trtllm_serve.paths.total() > scraped, 10, "another scrape of the trtllm page")
        assert set(trtllm_serve.paths) == {"/prometheus/metrics"}
    finally:
        picker.stop()


def test_endpoints_sharing_an_ip_keep_their_own_metrics_port(log_dir: Path) -> None:
    """As the reference applies --model-server-metrics-port only to pods with one target port:
    two ranks of one pod (one IP) are each scraped on their own port."""
    host = loopback_addresses(1)[0].rsplit(":", 1)[0]
    ranks = [TrtllmServe(host, waiting=3), TrtllmServe(host, waiting=5)]
    threads = [threading.Thread(target=r.serve_forever, daemon=True) for r in ranks]
    for thread in threads:
        thread.start()
    endpoints = [f"{host}:{r.server_address[1]}" for r in ranks]
    picker = start_picker(
        log_dir,
        "--endpoints", ",".join(endpoints),
        "--model-server-metrics-path", "/prometheus/metrics",
        "--model-server-metrics-port", str(free_port(host)),  # nothing listens there
        "--refresh-prometheus-metrics-interval", "50ms",
        "--config-text", TRTLLM_CONFIG,
        name="picker-ranks",
    )  # fmt: skip
    try:
        queues = {e: f'inference_pool_per_pod_queue_size{{model_server_pod="{e}",name=""}}' for e in endpoints}
        wait_until(
            lambda: [scrape(picker.metrics_port).get(q) for q in queues.values()] == [3, 5], 10, "both ranks' queues"
        )
    finally:
        picker.stop()
        for rank in ranks:
            rank.shutdown()
            rank.server_close()
