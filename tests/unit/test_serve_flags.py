"""`picker serve`'s flags against the reference EPP v1.5.0's: every one listed in --help, and
each accepted with the reference meaning or refused at start with an error naming it."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client import REGISTRY

from picker.config.runtime import RuntimeHolder
from picker.config.schema import ConfigError
from picker.datalayer.plugins import DataSource, ScrapeSettings, scrape_settings
from picker.datastore.store import Datastore
from picker.discovery.static import EndpointListError
from picker.requestcontrol.director import Director
from picker.serve.flags import FlagError, build_parser, log_settings, serve_options
from picker.serve.options import ReferenceFeatures
from picker.serve.server import PickerServer
from picker.telemetry.logging import TRACE, VERBOSE

# The reference's flags, from its source: pkg/epp/server/options.go (AddFlags),
# pkg/common/observability/logging/options.go (-v) and controller-runtime's zap BindFlags; the
# same 37 names the v1.5.0 binary prints in its "Flags processed" start-up line (its --help
# hides the nine deprecated ones).
REFERENCE_FLAGS = (
    "grpc-port",
    "ha-enable-leader-election",
    "pool-group",
    "pool-namespace",
    "pool-name",
    "endpoint-selector",
    "endpoint-target-ports",
    "disable-endpoint-subset-filter",
    "model-server-metrics-scheme",
    "model-server-metrics-path",
    "model-server-metrics-port",
    "model-server-metrics-https-insecure-skip-verify",
    "refresh-metrics-interval",
    "refresh-prometheus-metrics-interval",
    "metrics-staleness-threshold",
    "total-queued-requests-metric",
    "total-running-requests-metric",
    "kv-cache-usage-percentage-metric",
    "lora-info-metric",
    "cache-info-metric",
    "v",
    "zap-devel",
    "zap-encoder",
    "zap-log-level",
    "zap-stacktrace-level",
    "zap-time-encoding",
    "tracing",
    "health-checking",
    "metrics-port",
    "grpc-health-port",
    "enable-pprof",
    "cert-path",
    "enable-cert-reload",
    "secure-serving",
    "metrics-endpoint-auth",
    "config-file",
    "config-text",
)

REFUSED = "refused"
BASE = ["--endpoints", "10.0.0.1:8000"]


def server(*argv: str) -> PickerServer:
    return PickerServer(serve_options(build_parser().parse_args([*BASE, *argv])))


# flag → (arguments with a non-default value, what they must set, the value), or REFUSED.
Outcome = tuple[list[str], Callable[[PickerServer], Any], Any] | tuple[list[str], str]
TABLE: dict[str, Outcome] = {
    "grpc-port": (["--grpc-port", "9102"], lambda s: s.options.serving.grpc_port, 9102),
    "ha-enable-leader-election": (
        ["--pool-name", "pool", "--pool-namespace", "ns", "--ha-enable-leader-election"],
        lambda s: (s.features.leader_election, s.options.lease_name),
        (True, "epp-ns-pool.gateway-api-inference-extension.sigs.k8s.io"),  # the reference's Lease
    ),
    "pool-group": (
        ["--pool-group", "inference.networking.x-k8s.io"],
        lambda s: s.options.discovery.pool_group,
        "inference.networking.x-k8s.io",
    ),
    "pool-namespace": (["--pool-namespace", "ns"], lambda s: s.options.discovery.pool_namespace, "ns"),
    "pool-name": (["--pool-name", "pool"], lambda s: s.options.discovery.pool_name, "pool"),
    "endpoint-selector": (
        ["--endpoint-selector", "app=vllm"],
        lambda s: s.options.discovery.endpoint_selector,
        (("app", "vllm"),),
    ),
    "endpoint-target-ports": (
        ["--pool-name", "pool", "--endpoint-target-ports", "8000,8001"],
        lambda s: s.options.discovery.endpoint_target_ports,
        (8000, 8001),
    ),
    "disable-endpoint-subset-filter": (
        ["--disable-endpoint-subset-filter"],
        lambda s: s.options.scheduling.honour_subset_hint,
        False,
    ),
    "model-server-metrics-scheme": (
        ["--model-server-metrics-scheme", "https"],
        lambda s: s.options.data_layer.scrape.scheme,
        "https",
    ),
    "model-server-metrics-path": (
        ["--model-server-metrics-path", "/prometheus/metrics"],
        lambda s: s.options.data_layer.scrape.path,
        "/prometheus/metrics",
    ),
    "model-server-metrics-port": (
        ["--model-server-metrics-port", "8001"],
        lambda s: s.options.data_layer.scrape.port,
        8001,
    ),
    "model-server-metrics-https-insecure-skip-verify": (
        ["--model-server-metrics-https-insecure-skip-verify=false"],
        lambda s: s.options.data_layer.scrape.insecure_skip_verify,
        False,
    ),
    "refresh-metrics-interval": (["--refresh-metrics-interval", "100ms"], lambda s: s.data_layer.interval, 0.1),
    "refresh-prometheus-metrics-interval": (
        ["--refresh-prometheus-metrics-interval", "1s"],
        lambda s: s.data_layer.pool_gauges_interval,
        1.0,
    ),
    "metrics-staleness-threshold": (
        ["--metrics-staleness-threshold", "3s"],
        lambda s: s.data_layer.staleness_threshold,
        3.0,
    ),
    "total-queued-requests-metric": (["--total-queued-requests-metric", "sglang:num_queue_reqs"], REFUSED),
    "total-running-requests-metric": (["--total-running-requests-metric", "sglang:num_running_reqs"], REFUSED),
    "kv-cache-usage-percentage-metric": (["--kv-cache-usage-percentage-metric", "sglang:token_usage"], REFUSED),
    "lora-info-metric": (["--lora-info-metric", ""], REFUSED),
    "cache-info-metric": (["--cache-info-metric", "sglang:cache_config_info"], REFUSED),
    "v": (["-v=4"], lambda s: s.options.logging.threshold, logging.DEBUG),
    "zap-devel": (["--zap-devel=false"], lambda s: s.options.logging.json, True),
    "zap-encoder": (["--zap-encoder", "json"], lambda s: s.options.logging.json, True),
    "zap-log-level": (["--zap-log-level", "error"], lambda s: s.options.logging.threshold, logging.ERROR),
    "zap-stacktrace-level": (
        ["--zap-stacktrace-level", "panic"],
        lambda s: s.options.logging.stack_threshold,
        logging.CRITICAL,
    ),
    "zap-time-encoding": (["--zap-time-encoding", "rfc3339"], lambda s: s.options.logging.times, "rfc3339"),
    "tracing": (["--tracing=false"], lambda s: s.tracing, None),
    "health-checking": (["--health-checking"], lambda s: s.options.serving.health_checking, True),
    "metrics-port": (["--metrics-port", "9191"], lambda s: s.options.serving.metrics_port, 9191),
    "grpc-health-port": (["--grpc-health-port", "9103"], lambda s: s.options.serving.grpc_health_port, 9103),
    "enable-pprof": (["--enable-pprof"], lambda s: s.features.pprof, True),
    "cert-path": (["--cert-path", "/certs"], lambda s: s.options.tls.cert_path, "/certs"),
    "enable-cert-reload": (["--enable-cert-reload"], lambda s: s.options.tls.enable_cert_reload, True),
    "secure-serving": (["--secure-serving=false"], lambda s: s.options.tls.secure_serving, False),
    "metrics-endpoint-auth": (["--metrics-endpoint-auth=true"], lambda s: s.features.metrics_endpoint_auth, True),
    "config-file": (
        ["--config-file", "/config/epp.yaml"],
        lambda s: s.options.scheduling.config_file,
        "/config/epp.yaml",
    ),
    "config-text": (
        ["--config-text", "kind: EndpointPickerConfig"],
        lambda s: s.options.scheduling.config_text,
        "kind: EndpointPickerConfig",
    ),
}


def test_every_reference_flag_is_listed_by_picker_serve_help() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "picker.cli", "serve", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    listed = result.stdout
    missing = [flag for flag in REFERENCE_FLAGS if f"--{flag}" not in listed]
    assert missing == []
    assert "-v V, --v V" in listed  # the reference's shorthand too
    assert "==SUPPRESS==" not in listed
    hidden = [a.dest for a in build_parser()._actions if a.help == "==SUPPRESS=="]
    assert hidden == []


def test_the_table_covers_every_reference_flag() -> None:
    assert set(TABLE) == set(REFERENCE_FLAGS)


@pytest.mark.parametrize("flag", REFERENCE_FLAGS)
def test_each_reference_flag_is_honoured_or_refused_naming_it(flag: str) -> None:
    outcome = TABLE[flag]
    if outcome[1] == REFUSED:
        with pytest.raises(FlagError, match=f"^--{flag}: "):
            server(*outcome[0])
        return
    argv, read, expected = outcome  # type: ignore[misc]
    assert read(server(*argv)) == expected


def test_flags_with_a_reference_default_of_true_keep_the_picker_starting() -> None:
    """--metrics-endpoint-auth and --tracing default to true in the reference: left out they do
    not fail the start (tracing then exports only when an OTLP endpoint is configured); =false
    is honoured; leader election defaults to off, and --enable-pprof too (unlike the reference:
    see its help). Metrics auth is on by default where there is an API server to review tokens
    with (the pool or a selector), off with static endpoints."""
    s = server()
    assert s.features == ReferenceFeatures(
        leader_election=False, metrics_endpoint_auth=False, tracing=True, pprof=False
    )
    assert server("--pool-name", "pool").features.metrics_endpoint_auth is True
    assert server("--endpoint-selector", "app=vllm").features.metrics_endpoint_auth is True
    off = server("--metrics-endpoint-auth=false", "--tracing=false", "--enable-pprof=false")
    assert off.features == ReferenceFeatures(False, False, False, False)
    assert server("--ha-enable-leader-election=false").features.leader_election is False


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model-server-metrics-scheme", "ftp"], "--model-server-metrics-scheme"),
        (["--zap-encoder", "xml"], "--zap-encoder"),
        (["--zap-log-level", "0"], "--zap-log-level"),
        (["--zap-log-level", "verbose"], "--zap-log-level"),
        (["--zap-stacktrace-level", "debug"], "--zap-stacktrace-level"),
        (["--zap-time-encoding", "unix"], "--zap-time-encoding"),
        (["--v", "high"], "-v/--v"),
        (["--refresh-metrics-interval", "fast"], "--refresh-metrics-interval"),
        (["--tracing=maybe"], "--tracing"),
        (["--no-such-flag"], "--no-such-flag"),
        (["--workers", "0"], "--workers: must be from 1 to 64"),
        (["--workers", "two"], "--workers: expected a whole number"),
    ],
)
def test_bad_values_are_refused_naming_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(FlagError, match=message):
        build_parser().parse_args([*BASE, *argv])


def test_leader_election_needs_a_lease_to_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Lease is named after the pool or, with a selector, the Deployment ($POD_NAME, as the
    reference); static endpoints have no API server to hold it."""
    with pytest.raises(FlagError, match="^--ha-enable-leader-election: .*--pool-name or --endpoint-selector"):
        server("--ha-enable-leader-election")
    monkeypatch.delenv("POD_NAME", raising=False)
    with pytest.raises(ValueError, match="^--ha-enable-leader-election: .*POD_NAME"):
        server("--endpoint-selector", "app=vllm", "--pool-namespace", "ns", "--ha-enable-leader-election")
    monkeypatch.setenv("POD_NAME", "vllm-epp-5d8f7c9b4-x2x7q")
    elected = server("--endpoint-selector", "app=vllm", "--pool-namespace", "ns", "--ha-enable-leader-election")
    assert elected.options.lease_name == "epp-ns-vllm-epp.gateway-api-inference-extension.sigs.k8s.io"


def test_workers_refuse_leader_election() -> None:
    """The Lease is held by one process: several workers would each compete for it."""
    args = build_parser().parse_args([*BASE, "--workers", "2", "--pool-name", "p", "--ha-enable-leader-election"])
    with pytest.raises(FlagError, match="^--workers: leader election"):
        serve_options(args)
    assert serve_options(build_parser().parse_args([*BASE, "--workers", "2"])).serving.workers == 2


def test_an_empty_pool_namespace_is_the_pods_namespace_else_default() -> None:
    """As the reference: --pool-namespace left empty means $NAMESPACE, else `default`."""
    args = build_parser().parse_args(BASE)
    assert serve_options(args, {"NAMESPACE": "team-a"}).discovery.pool_namespace == "team-a"
    assert serve_options(args, {}).discovery.pool_namespace == "default"
    given = build_parser().parse_args([*BASE, "--pool-namespace", "ns"])
    assert serve_options(given, {"NAMESPACE": "team-a"}).discovery.pool_namespace == "ns"
    assert args.pool_namespace == ""  # resolved into the options, the parsed flags left as given


def test_flag_values_that_cannot_be_used_are_refused_at_start() -> None:
    with pytest.raises(EndpointListError, match="^--endpoint-selector: expected k=v"):
        server("--endpoint-selector", "app")
    with pytest.raises(EndpointListError, match="^--endpoint-target-ports: expected ports"):
        server("--pool-name", "pool", "--endpoint-target-ports", "80,http")
    with pytest.raises(ConfigError, match="mutually exclusive"):
        server("--config-file", "a.yaml", "--config-text", "kind: EndpointPickerConfig")


def test_model_server_metrics_path_and_port_are_checked() -> None:
    with pytest.raises(FlagError, match="^--model-server-metrics-path: must start with '/'"):
        server("--model-server-metrics-path", '"/prometheus/metrics"')  # the quotes a YAML list keeps
    with pytest.raises(FlagError, match="^--model-server-metrics-port: "):
        server("--model-server-metrics-port", "70000")
    assert server().options.data_layer.scrape == ScrapeSettings()


@pytest.mark.parametrize(
    ("argv", "threshold"),
    [
        ([], logging.INFO),
        (["-v", "3"], VERBOSE),
        (["-v=4"], logging.DEBUG),
        (["--v=4"], logging.DEBUG),
        (["-v5"], TRACE),
        (["-v=-1"], logging.INFO),  # negative: the default, as the reference's Validate
        (["-v=1"], logging.INFO + 1),  # V(2) info lines hidden, warnings kept
        (["-v=4", "--zap-log-level=info"], logging.INFO + 1),  # --zap-log-level overrides -v
        (["-v=4", "--zap-log-level=debug"], logging.INFO + 1),  # zap's debug is V(1)
        (["--zap-log-level=4"], logging.DEBUG),
        (["--zap-log-level=panic"], logging.CRITICAL),
    ],
)
def test_verbosity_follows_the_reference_levels(argv: list[str], threshold: int) -> None:
    assert log_settings(build_parser().parse_args(argv)).threshold == threshold


@pytest.mark.parametrize(
    ("argv", "json", "stack", "times"),
    [
        ([], False, logging.WARNING, "iso8601"),  # --zap-devel defaults to true: console, stacks from warn
        (["--zap-devel=false"], True, logging.ERROR, "epoch"),
        (["--zap-encoder=json"], True, logging.WARNING, "epoch"),  # the chart's arguments
        (["--zap-devel=false", "--zap-encoder=console"], False, logging.ERROR, "iso8601"),
        (
            ["--zap-encoder=json", "--zap-stacktrace-level=info", "--zap-time-encoding=nano"],
            True,
            logging.INFO + 1,
            "nano",
        ),
    ],
)
def test_zap_flags_choose_encoder_stacktraces_and_time(argv: list[str], json: bool, stack: int, times: str) -> None:
    settings = log_settings(build_parser().parse_args(argv))
    assert (settings.json, settings.stack_threshold, settings.times) == (json, stack, times)


def test_bad_flags_are_logged_as_json_and_exit_2() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "picker.cli", "serve", "--zap-encoder=json", "--v=x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    record = json.loads(line)
    assert record["level"] == "error" and "-v/--v" in record["msg"]


HEADER = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"


def data_sources(source_parameters: str) -> tuple[DataSource, ...] | None:
    store = Datastore()
    text = (
        HEADER + "plugins:\n- type: queue-scorer\n"
        f"- {{name: source, type: metrics-data-source, parameters: {source_parameters}}}\n"
        "dataLayer: {sources: [{pluginRef: source}]}\n"
    )
    return RuntimeHolder(store).load_text(text).data_sources


def test_the_config_s_metrics_source_parameters_override_the_flags_which_override_defaults() -> None:
    """The reference's precedence: built-in defaults < --model-server-metrics-* < the
    metrics-data-source plugin's parameters; the port has no parameter."""
    flags = server(
        "--model-server-metrics-path", "/prometheus/metrics",
        "--model-server-metrics-scheme", "https",
        "--model-server-metrics-https-insecure-skip-verify=false",
        "--model-server-metrics-port", "8001",
    ).options.data_layer.scrape  # fmt: skip
    assert scrape_settings(None, flags) == flags  # no dataLayer: the flags
    assert scrape_settings(data_sources("{}"), flags) == flags
    explicit = scrape_settings(data_sources("{path: /metrics, scheme: http, insecureSkipVerify: true}"), flags)
    assert explicit == ScrapeSettings("/metrics", "http", True, port=8001)
    partly = scrape_settings(data_sources("{path: /engine/metrics}"), flags)
    assert partly == ScrapeSettings("/engine/metrics", "https", False, port=8001)
    assert scrape_settings((), flags) is None  # sources: [] turns scraping off


def test_the_pool_saturation_gauge_reads_the_servers_flow_control_whatever_is_built_after() -> None:
    picker = server()
    picker.runtimes.load_text(
        "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nfeatureGates: [flowControl]\n"
    )
    Director(Datastore(), RuntimeHolder())  # built later, e.g. by a benchmark in the process: the gate off, 0.0
    saturation = REGISTRY.get_sample_value("inference_extension_flow_control_pool_saturation", {"inference_pool": ""})
    assert saturation == 1.0  # the server's pool: nothing in it yet, so saturated as its gate sees it
