"""`--tracing`: requests routed through real Envoy, the picker and `picker sim` pods arrive at an
OTLP gRPC endpoint as one `gateway.request` span each, with its orchestration and plugin spans.

The OpenTelemetry collector binary is not installable here: the receiver is a real gRPC server
implementing OTLP's TraceService from `opentelemetry-proto`'s generated servicer, standing in
for the collector's OTLP gRPC receiver (the same service and messages).
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

from picker_bench.process import free_port, wait_until
from picker_bench.soak import MODEL, start_sim_pods
from tests.stack import start_envoy, start_picker

CONFIG = """apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
  - pluginRef: kv-cache-utilization-scorer
  - pluginRef: prefix-cache-scorer
  - pluginRef: max-score-picker
"""
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every span exported to it, with its resource's attributes."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: list[tuple[dict[str, Any], trace_pb2.Span]] = []

    def Export(  # noqa: N802 (the generated servicer's name)
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        with self.lock:
            for resource_spans in request.resource_spans:
                resource = attributes(resource_spans.resource.attributes)
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend((resource, span) for span in scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def named(self, name: str) -> list[trace_pb2.Span]:
        with self.lock:
            return [span for _, span in self.spans if span.name == name]


def attributes(pairs: Any) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for kv in pairs:
        kind = kv.value.WhichOneof("value")
        result[kv.key] = getattr(kv.value, kind) if kind else None
    return result


@pytest.fixture()
def receiver() -> Iterator[tuple[OtlpReceiver, str]]:
    servicer = OtlpReceiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    yield servicer, f"http://127.0.0.1:{port}"
    server.stop(grace=None)


def post(url: str, body: bytes, headers: dict[str, str]) -> int:
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"content-type": "application/json", **headers})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=15) as response:
            response.read()
            return int(response.status)
    except urllib.error.HTTPError as error:
        error.read()
        return int(error.code)


def test_each_routed_request_is_one_request_span_with_plugin_children_at_the_otlp_endpoint(
    receiver: tuple[OtlpReceiver, str], log_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    collector, endpoint = receiver
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "picker-under-test")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "1")  # the reference's parentbased_traceidratio, every trace
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # the batch exporter's delay (ms): a quick test
    sim, pods = start_sim_pods(2, log_dir, name="sim-tracing")
    picker = envoy = None
    try:
        config = tmp_path / "config.yaml"
        config.write_text(CONFIG)
        picker = start_picker(
            log_dir, "--endpoints", ",".join(pods), "--config-file", str(config), name="picker-tracing"
        )
        envoy = start_envoy("duplex", picker.grpc_port, log_dir, name="envoy-tracing")
        ids = [f"traced-{n}" for n in range(4)]
        for n, request_id in enumerate(ids):
            body = json.dumps({"model": MODEL, "prompt": f"question {n}", "max_tokens": 2}).encode()
            headers = {"x-request-id": request_id}
            if n == 0:  # a caller's W3C trace context: the picker's spans join its trace
                headers["traceparent"] = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"
            assert post(envoy.url, body, headers) == 200
        assert post(envoy.url, b'{"model": "m", "prompt": "trunc', {"x-request-id": "traced-bad"}) == 400

        wait_until(lambda: len(collector.named("gateway.request")) >= len(ids) + 1, 20, "the request spans")
        requests = {attributes(s.attributes)["request_id"]: s for s in collector.named("gateway.request")}
        assert sorted(requests) == sorted([*ids, "traced-bad"])  # one span per request
        orchestrations = {s.parent_span_id: s for s in collector.named("gateway.request_orchestration")}
        with collector.lock:
            resource = collector.spans[0][0]
            by_parent: dict[bytes, list[trace_pb2.Span]] = {}
            for _, span in collector.spans:
                by_parent.setdefault(span.parent_span_id, []).append(span)
        assert resource["service.name"] == "picker-under-test"

        for request_id in ids:
            span = requests[request_id]
            assert span.kind == trace_pb2.Span.SPAN_KIND_SERVER
            fields = attributes(span.attributes)
            assert fields["model"] == MODEL and fields["target_model"] == MODEL
            assert fields["endpoint"] in pods
            assert fields["http.response.status_code"] == 200
            assert span.status.code != trace_pb2.Status.STATUS_CODE_ERROR
            orchestration = orchestrations[span.span_id]
            assert attributes(orchestration.attributes)["target_model"] == MODEL
            assert attributes(orchestration.attributes)["request_prio"] == 0
            assert span.start_time_unix_nano <= orchestration.start_time_unix_nano
            assert orchestration.end_time_unix_nano <= span.end_time_unix_nano
            plugins = {s.name: attributes(s.attributes) for s in by_parent[orchestration.span_id]}
            assert {"Scorer queue-scorer", "Scorer kv-cache-utilization-scorer", "Scorer prefix-cache-scorer",
                    "Picker max-score-picker"} <= plugins.keys()  # fmt: skip
            assert plugins["Scorer queue-scorer"] == {
                "plugin.extension_point": "Scorer",
                "plugin.type": "queue-scorer",
                "plugin.name": "queue-scorer",
            }
            assert any(p["plugin.extension_point"] == "ProfileHandler" for p in plugins.values())
            for child in by_parent[orchestration.span_id]:
                assert orchestration.start_time_unix_nano <= child.start_time_unix_nano
                assert child.start_time_unix_nano <= child.end_time_unix_nano <= orchestration.end_time_unix_nano

        joined = requests[ids[0]]
        assert joined.trace_id.hex() == CALLER_TRACE and joined.parent_span_id.hex() == CALLER_SPAN
        assert all(requests[i].trace_id.hex() != CALLER_TRACE for i in ids[1:])
        bad = requests["traced-bad"]
        assert bad.status.code == trace_pb2.Status.STATUS_CODE_ERROR
        assert orchestrations[bad.span_id].status.code == trace_pb2.Status.STATUS_CODE_ERROR
    finally:  # whatever started, even if a later start failed
        for process in (envoy, picker, sim):
            if process is not None:
                process.stop()
