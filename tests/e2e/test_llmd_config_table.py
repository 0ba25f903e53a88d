"""llm-d v0.4.0's reference configs (every `deploy/config/*.yaml` of its Go module, read there at
test time) through llm-d's own scheduler and through picker, side by side.

llm-d's binary (`llmd-epp-v0.4.0`, from the shared Go-module builder) runs each file over the real
API server, against an InferencePool of labelled Pods: it either serves (its health service says
SERVING) and logs the scheduler it built ("parsed config": profile handler, each profile's
filters, scorers with weights and picker) and its prefix index's settings, or exits with its
error. picker must accept exactly the files llm-d accepts, with that same scheduler as
`picker config show` resolves it (and the prefix settings llm-d logs), and refuse the others
naming the parameter llm-d names. Beside llm-d's files, a few written here (`EXTRA_CONFIGS`, and
its precise sample filled in as the bench runs it) do the same for llm-d's types and parameters
that no file of its uses, and for bad parameters. Then `picker serve --config-file` runs each file behind Envoy
in front of a `picker sim --pd 1:2` fleet (endpoints labelled with their roles): an accepted file
serves, and its decisions keep to what it says (decode-filter: never the prefill pod; the prefix
scorers: a prompt again goes to the pod that holds it); a refused one exits with its error.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from kubernetes import client
from prometheus_client.parser import text_string_to_metric_families

from picker.scheduling.labels import ROLE_LABEL
from picker_bench.kube_cluster import KubeCluster
from picker_bench.kube_resources import create_pod, put_pool, set_pod_ready
from picker_bench.llmd import LLMD
from picker_bench.llmd_epp import llmd_env, llmd_flags, precise_config, write_builtin_tokenizer
from picker_bench.process import free_port
from picker_bench.reference_epp import start_reference_epp
from picker_bench.systems import FleetPod, write_endpoints_file
from tests.e2e.kube_resources import create_namespace
from tests.sim_fixtures import delta, pod_metrics, start_sim, stop_process
from tests.stack import start_envoy, start_picker

# On a fresh machine llm-d's binary is built first: about 20 minutes of CPU on 2 cores
# (tools/install-test-binaries.sh builds it before the suite, so `make test` does not wait here).
pytestmark = pytest.mark.timeout(3600)

POOL = "llmd-configs"
POD_LABELS = {"app": "llmd-configs"}
CHARS_PER_TOKEN = 4  # llm-d v0.4.0's prefix scorer (the reference's v1.2.0) hashes 4 characters a token
SERVED = "vllm:e2e_request_latency_seconds_count"
# A prompt of 40 prefix blocks (16 tokens of 4 characters), unlike any other prompt here.
PROMPT = "".join(f"{i:04d}" for i in range(640))
# Files whose destination is not the pick's own port: data-parallel ranks behind `primaryPort`
# (8000, where the sim pods do not listen); routed in tests/unit/test_llmd_configs.py instead.
PRIMARY_PORT_CONFIGS = ("dp-epp-config.yaml",)


def one_profile(plugins: list[dict[str, Any]], refs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": plugins,
        "schedulingProfiles": [{"name": "default", "plugins": refs}],
    }


def alone(plugin_type: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return one_profile([{"type": plugin_type, "parameters": parameters}], [{"pluginRef": plugin_type}])


# name → (config, the parameter both refuse it for; None: both accept it)
EXTRA_CONFIGS: dict[str, tuple[dict[str, Any], str | None]] = {
    "every-other-llmd-type": (
        one_profile(
            [
                {"type": "by-label", "name": "gpu", "parameters": {"label": "hw", "validValues": ["h100"]}},
                {
                    "type": "by-label-selector",
                    "name": "zone",
                    "parameters": {"matchExpressions": [{"key": "zone", "operator": "NotIn", "values": ["b"]}]},
                },
                {"type": "load-aware-scorer", "parameters": {"threshold": 64}},
                {"type": "active-request-scorer", "parameters": {"requestTimeout": "30s"}},
                {"type": "session-affinity-scorer"},
                {"type": "no-hit-lru-scorer", "parameters": {"lruSize": 512}},
                {"type": "prefix-cache-scorer"},
                {"type": "random-picker"},
            ],
            [
                {"pluginRef": "gpu"},
                {"pluginRef": "zone"},
                {"pluginRef": "load-aware-scorer", "weight": 1},
                {"pluginRef": "active-request-scorer", "weight": 2},
                {"pluginRef": "session-affinity-scorer", "weight": 3},
                {"pluginRef": "no-hit-lru-scorer", "weight": 1},
                {"pluginRef": "prefix-cache-scorer", "weight": 1},
                {"pluginRef": "random-picker"},
            ],
        ),
        None,
    ),
    "by-label-without-label": (alone("by-label", {"validValues": ["x"]}), "label"),
    "by-label-without-values": (alone("by-label", {"label": "x"}), "validValues"),
    "by-label-selector-bad-operator": (
        alone("by-label-selector", {"matchExpressions": [{"key": "a", "operator": "Near", "values": ["b"]}]}),
        "operator",
    ),
    "load-aware-threshold-string": (alone("load-aware-scorer", {"threshold": "high"}), "threshold"),
    "active-request-timeout-number": (alone("active-request-scorer", {"requestTimeout": 30}), "requestTimeout"),
}


@dataclass(frozen=True)
class Profile:
    """One scheduling profile as built: filter names, scorer name → weight, picker name."""

    filters: tuple[str, ...]
    scorers: dict[str, float]
    picker: str


@dataclass(frozen=True)
class Scheduler:
    handler: str
    profiles: dict[str, Profile]


@dataclass(frozen=True)
class LlmdVerdict:
    """What llm-d's binary made of a file: the scheduler and the prefix scorers' settings it
    logged when it served, else its error."""

    scheduler: Scheduler | None
    prefix_config: dict[str, Any] | None = None  # the approximate scorer's ("PrefixCachePlugin initialized")
    precise_block_size: int | None = None  # the precise indexer's ("NewKVCacheIndexer config")
    error: str = ""


def config_files() -> list[Path]:
    """Every `deploy/config/*.yaml` of llm-d's module, in the Go module cache."""
    files = sorted((LLMD.source_dir() / "deploy" / "config").glob("*.yaml"))
    assert files, "llm-d's module has no deploy/config/*.yaml"
    return files


def logged_field(log: str, message: str, key: str) -> Any:
    """The field `key` of the last zap console line whose message is `message`, or None."""
    lines = [line for line in log.splitlines() if f"\t{message}\t" in line]
    return json.loads(lines[-1].split("\t")[-1])[key] if lines else None


def parse_llmd_scheduler(text: str) -> Scheduler:
    """llm-d's "parsed config" scheduler: `{ProfileHandler: NAME/TYPE, Profiles: map[P:{Filters:
    [NAME/TYPE ...], Scorers: [NAME/TYPE: WEIGHT, ...], Picker: NAME/TYPE} ...]}`."""
    handler = re.search(r"ProfileHandler: ([^/]+)/", text)
    assert handler is not None, text
    profiles = {}
    pattern = r"([\w-]+):\{Filters: \[([^\]]*)\], Scorers: \[([^\]]*)\], Picker: ([^/]+)/[^}]*\}"
    for name, filters, scorers, picker in re.findall(pattern, text):
        weighted = (item.rsplit(": ", 1) for item in scorers.split(", ") if item)
        profiles[name] = Profile(
            tuple(f.split("/")[0] for f in filters.split()),
            {scorer.split("/")[0]: float(weight) for scorer, weight in weighted},
            picker,
        )
    assert profiles, text
    return Scheduler(handler[1], profiles)


def picker_scheduler(document: dict[str, Any]) -> Scheduler:
    """The scheduler of `picker config show`'s effective config: a profile's plugin with a weight
    is a scorer, a `*-picker` its picker, any other a filter."""
    types = {plugin["name"]: plugin["type"] for plugin in document["plugins"]}
    (handler,) = [name for name, kind in types.items() if kind.endswith("-profile-handler")]
    profiles = {}
    for profile in document["schedulingProfiles"]:
        refs = profile["plugins"]
        (picker,) = [r["pluginRef"] for r in refs if types[r["pluginRef"]].endswith("-picker")]
        scorers = {r["pluginRef"]: float(r["weight"]) for r in refs if "weight" in r}
        filters = tuple(r["pluginRef"] for r in refs if r["pluginRef"] not in scorers and r["pluginRef"] != picker)
        profiles[profile["name"]] = Profile(filters, scorers, picker)
    return Scheduler(handler, profiles)


def picker_show(path: Path) -> subprocess.CompletedProcess[str]:
    """`picker config show --config-file PATH`, as a user runs it."""
    argv = [sys.executable, "-m", "picker.cli", "config", "show", "--config-file", str(path)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[FleetPod]]:
    """One prefill and two decode `picker sim` pods."""
    proc, lines = start_sim(["--pd", "1:2", "--base-port", "0", "--profile", "tiny"])
    try:
        yield [FleetPod.parse(line) for line in lines]
    finally:
        stop_process(proc)


@pytest.fixture(scope="module")
def pool_namespace(admin_api: client.ApiClient) -> str:
    """A prefill and two decode Pods of an InferencePool, Ready, one address each (llm-d tells
    pods apart by address; it needs them listed only, not answering)."""
    namespace = create_namespace(admin_api, POOL)
    for i, role in enumerate(("prefill", "decode", "decode")):
        name = f"{role}-{i}"
        create_pod(admin_api, namespace, name, {**POD_LABELS, ROLE_LABEL: role})
        set_pod_ready(admin_api, namespace, name, f"127.0.0.{10 + i}")
    put_pool(admin_api, namespace, POOL, POD_LABELS, [8000])
    return namespace


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def precise_filled_in(directory: Path) -> dict[str, Any]:
    """llm-d's precise sample with what a deployment fills in, as the bench runs it
    (`picker_bench.llmd_epp.precise_config`: the engines' block size, its subscriber's endpoint,
    a local tokenizer), the tokenizer by its absolute path."""
    config = precise_config(16, f"tcp://*:{free_port()}", "sim-model")
    (scorer,) = [p for p in config["plugins"] if p["type"] == "precise-prefix-cache-scorer"]
    tokenizers = scorer["parameters"]["indexerConfig"]["tokenizersPoolConfig"]
    tokenizers["local"]["modelTokenizerMap"] = {"sim-model": str(write_builtin_tokenizer(directory / "sim-model"))}
    return config


def llmd_verdict(binary: Path, cluster: KubeCluster, namespace: str, path: Path, log_dir: Path) -> LlmdVerdict:
    """Run llm-d's scheduler with the file until it serves or exits."""
    name = f"llmd-{path.stem}"
    try:
        process = start_reference_epp(
            binary,
            cluster.admin_kubeconfig,
            POOL,
            namespace,
            free_port(),
            False,
            log_dir,
            config_file=path,
            name=name,
            extra_args=llmd_flags(),
            extra_env=llmd_env(),
        )
    except RuntimeError:  # it exited: the log says why
        log = (log_dir / f"{name}.log").read_text()
        return LlmdVerdict(None, error=logged_field(log, "Failed to parse configuration", "error") or log[-2000:])
    process.stop()
    log = (log_dir / f"{name}.log").read_text()
    return LlmdVerdict(
        parse_llmd_scheduler(logged_field(log, "parsed config", "scheduler-config")),
        logged_field(log, "PrefixCachePlugin initialized", "config"),
        logged_field(log, "NewKVCacheIndexer config", "blockSize"),
    )


def assert_same_meaning(name: str, llmd: LlmdVerdict, shown: str) -> None:
    document = yaml.safe_load(shown)
    assert llmd.scheduler is not None
    assert picker_scheduler(document) == llmd.scheduler, name
    parameters = {plugin["type"]: plugin.get("parameters", {}) for plugin in document["plugins"]}
    if llmd.prefix_config is not None:
        producer = parameters["approx-prefix-cache-producer"]
        expected = {
            key: llmd.prefix_config[key] for key in ("autoTune", "maxPrefixBlocksToMatch", "lruCapacityPerServer")
        }
        assert {key: producer[key] for key in expected} == expected, name
        assert producer["blockSizeTokens"] * CHARS_PER_TOKEN == llmd.prefix_config["blockSize"], name
    if llmd.precise_block_size is not None:
        assert parameters["precise-prefix-cache-scorer"]["blockSizeTokens"] == llmd.precise_block_size, name


def test_picker_accepts_what_llmd_accepts_with_the_same_scheduler_and_refuses_what_it_refuses(
    llmd_binary: Path, kube_cluster: KubeCluster, pool_namespace: str, tmp_path: Path
) -> None:
    rows: list[tuple[Path, str | None]] = []
    for path in config_files():
        rows.append((path, None))  # the parameter: the Go struct field llm-d's JSON error names
    for name, (config, parameter) in {
        **EXTRA_CONFIGS,
        "precise-filled-in": (precise_filled_in(tmp_path), None),
    }.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        rows.append((path, parameter))
    verdicts = []
    for path, parameter in rows:
        llmd = llmd_verdict(llmd_binary, kube_cluster, pool_namespace, path, tmp_path)
        shown = picker_show(path)
        verdicts.append(llmd.scheduler is not None)
        if llmd.scheduler is not None:
            assert shown.returncode == 0, (path.name, shown.stderr)
            assert_same_meaning(path.name, llmd, shown.stdout)
            continue
        assert shown.returncode == 1 and shown.stdout == "", (path.name, shown.stdout)
        field = re.search(r"Go struct field \w+\.(\w+)", llmd.error)
        parameter = parameter or (field[1] if field else None)
        assert parameter is not None and parameter in llmd.error, (path.name, llmd.error)
        (message,) = shown.stderr.splitlines()  # one error: the one llm-d has
        assert re.fullmatch(rf"plugins\[\d+\]\.parameters\.(\S+\.)?{parameter}: .+", message), (path.name, message)
    assert True in verdicts and False in verdicts, verdicts


def approximates(document: dict[str, Any]) -> bool:
    """Whether a profile of the effective config scores with `prefix-cache-scorer`."""
    types = {plugin["name"]: plugin["type"] for plugin in document["plugins"]}
    scorers = (name for profile in picker_scheduler(document).profiles.values() for name in profile.scorers)
    return any(types[name] == "prefix-cache-scorer" for name in scorers)


def prefill_decode_decisions(page: str) -> float:
    """llm-d's P/D decision counter's `prefill-decode` sample on a picker's /metrics page."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(page)
        for sample in family.samples
        if sample.name == "llm_d_inference_scheduler_pd_decision_total"
        and sample.labels.get("decision_type") == "prefill-decode"
    )


async def served(http: aiohttp.ClientSession, fleet: list[FleetPod]) -> dict[str, float]:
    return {pod.address: (await pod_metrics(http, pod.address)).get(SERVED, 0.0) for pod in fleet}


async def test_picker_serves_each_accepted_file_keeping_to_its_decisions(
    fleet: list[FleetPod], tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    endpoints = write_endpoints_file(fleet, tmp_path / "endpoints.yaml")
    grpc_port = free_port()
    envoy = start_envoy("duplex", grpc_port, tmp_path, name="envoy-llmd-configs")
    prefill = {pod.address for pod in fleet if pod.role == "prefill"}
    try:
        for path in config_files():
            shown = picker_show(path)
            args = ("--config-file", str(path), "--endpoints-file", str(endpoints))
            if shown.returncode != 0:
                with pytest.raises(RuntimeError) as exited:
                    start_picker(tmp_path, *args, name=f"picker-{path.stem}", grpc_port=grpc_port)
                assert shown.stderr.strip() in str(exited.value), path.name
                continue
            picker = start_picker(tmp_path, *args, name=f"picker-{path.stem}", grpc_port=grpc_port)
            try:
                if path.name in PRIMARY_PORT_CONFIGS:
                    continue
                before = await served(http, fleet)
                holders = []
                for _ in range(2):
                    await complete(http, envoy.url)
                    after = await served(http, fleet)
                    (holder,) = [address for address in after if delta(after, before, address) == 1]
                    holders.append(holder)
                    before = after
                assert not prefill & set(holders), (path.name, holders)  # decode-filter
                document = yaml.safe_load(shown.stdout)
                if approximates(document):  # the approximate index knows the holder
                    assert holders[0] == holders[1], (path.name, holders)
                if picker_scheduler(document).handler == "pd-profile-handler":
                    # A cold prompt far above the threshold (0 by default) was disaggregated.
                    async with http.get(f"http://127.0.0.1:{picker.metrics_port}/metrics") as page:
                        assert prefill_decode_decisions(await page.text()) >= 1, path.name
            finally:
                picker.stop()
    finally:
        envoy.stop()


async def complete(http: aiohttp.ClientSession, url: str) -> None:
    body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 2}
    async with http.post(f"{url}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=30)) as answer:
        assert answer.status == 200, await answer.text()
