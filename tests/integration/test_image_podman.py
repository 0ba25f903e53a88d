"""`make image` really builds the picker image from the Dockerfile, and the image runs as the
chart runs it: a real podman builds it, and `picker serve` in it (non-root, read-only root
filesystem, no capabilities) answers the gRPC health checks the chart probes SERVING and routes
a request from a real Envoy to a real backend, through both shipped Envoy configs (one of them
the chart's Envoy sidecar's: the standalone pair).

No Docker daemon runs on the test machines and Docker Hub is out of their reach, so the base
image is built from Debian's packages (tools/build-base-image.sh; tools/install-test-binaries.sh
caches it and installs podman) and passed as BASE_IMAGE. podman keeps its images in a store of
its own under ~/.cache/picker that outlives the run: every run builds through `make image`, and
a later run reuses the layers the source it builds has not changed (the dependencies' layer
while pyproject.toml is the same). Images no tag or build cache keeps are pruned after each run."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import resource
import shutil
import subprocess
import tomllib
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from picker_bench.process import ManagedProcess, free_port, wait_until
from tests.e2e.charts import chart_image
from tests.stack import health_status, loopback_addresses, serving, start_backends, start_envoy

ROOT = Path(__file__).resolve().parents[2]
IMAGE_DIR = Path(os.environ.get("PICKER_IMAGE_DIR", Path.home() / ".cache" / "picker" / "images"))
BASE_TARBALL = IMAGE_DIR / "debian-bookworm-python3.11.tar"
# podman's images and build cache (a few GB), kept between runs.
STORE = Path(os.environ.get("PICKER_PODMAN_DIR", Path.home() / ".cache" / "picker" / "podman"))
STORE_BUSY_TIMEOUT = 600  # seconds to wait while another run of this module uses the store
BASE_IMAGE = "localhost/picker-base:bookworm"
BUILD_CACHE = "localhost/picker-build-cache"  # tagged stages of the last build (their layers stay)
SHARED_MEMORY = Path("/dev/shm")
INSTALL_HINT = "run tools/install-test-binaries.sh (make test does) to install it"
# What the chart's probes ask (inference-extension with one replica, liveness/readiness with more).
PROBED = ("inference-extension", "liveness", "readiness", "")
SERVING = health_pb2.HealthCheckResponse.SERVING

# The build installs the picker and its tokenizer extra from PyPI.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


@dataclass(frozen=True)
class Podman:
    """podman with its storage, state and settings in one directory of its own."""

    binary: str
    env: dict[str, str]

    def __call__(self, *args: str, timeout: float = 120) -> str:
        done = subprocess.run(
            [self.binary, *args], env=self.env, capture_output=True, text=True, timeout=timeout, check=False
        )
        assert done.returncode == 0, f"podman {' '.join(args)} failed:\n{done.stderr}"
        return done.stdout


def within_hard_limit(limit: int, wanted: int) -> int:
    """`wanted`, lowered to the hard resource `limit` (which RLIM_INFINITY does not bound)."""
    return wanted if limit == resource.RLIM_INFINITY else min(wanted, limit)


def podman_in(store: Path, state: Path) -> Podman:
    """podman set up for this machine: its images in `store`, its runtime state and locks in
    `state`, which must be on a file system a reboot empties (podman then knows to reset it)."""
    binary = shutil.which("podman")
    if binary is None or shutil.which("runc") is None:
        pytest.fail(f"podman and runc are needed: {INSTALL_HINT}", pytrace=False)
    store.mkdir(parents=True, exist_ok=True)
    storage, containers = store / "storage.conf", store / "containers.conf"
    # skip_mount_home: no bind mount of the store over itself that would outlive the test.
    storage.write_text(
        f'[storage]\ndriver = "overlay"\ngraphroot = "{store / "graph"}"\nrunroot = "{state / "run"}"\n'
        '[storage.options.overlay]\nskip_mount_home = "true"\n'
    )
    # Root here lacks CAP_SYS_RESOURCE, so a container may not raise a limit above podman's own
    # (podman's defaults do; as root it lowers its own nproc to 32768). Host networking: the build
    # reaches PyPI as the machine does, and no bridge or private-range address is made. runc:
    # crun refuses this machine's hybrid cgroup hierarchy. File locks in tmp_dir: the default
    # shared-memory locks are one segment for every podman on the machine.
    nofile = within_hard_limit(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 1 << 16)
    nproc = within_hard_limit(resource.getrlimit(resource.RLIMIT_NPROC)[1], 4096)
    containers.write_text(
        f'[containers]\ndefault_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]\nnetns = "host"\n'
        f'[engine]\nruntime = "runc"\ntmp_dir = "{state / "libpod"}"\nlock_type = "file"\n'
    )
    env = {**os.environ, "CONTAINERS_STORAGE_CONF": str(storage), "CONTAINERS_CONF": str(containers)}
    return Podman(binary, env)


def runtime_state_directory(store: Path) -> Path:
    """Where podman keeps the runtime state of `store`: in memory, one directory per store."""
    return SHARED_MEMORY / f"picker-podman-{hashlib.sha256(str(store).encode()).hexdigest()[:16]}"


@contextmanager
def holding(lock_file: Path, timeout: float) -> Iterator[None]:
    """An exclusive lock on `lock_file` while the block runs: one run of this module at a time
    uses the store (another would retag the image this one tests). Fails after `timeout` s."""
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with lock_file.open("w") as held:

        def acquired() -> bool:
            try:
                fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            return True

        # Another run holds it for minutes: poll gently.
        wait_until(acquired, timeout, f"{lock_file} to be unlocked by another run", interval=1.0)
        yield


@pytest.fixture(scope="module")
def podman() -> Iterator[Podman]:
    if not BASE_TARBALL.is_file():
        pytest.fail(f"the base image root filesystem {BASE_TARBALL} is missing: {INSTALL_HINT}", pytrace=False)
    with holding(STORE / "lock", STORE_BUSY_TIMEOUT):
        engine = podman_in(STORE, runtime_state_directory(STORE))
        engine("rm", "--all", "--force")  # what an interrupted run left
        # The same tarball imports as the same image, so the layers built on it stay cached.
        engine("import", "--quiet", str(BASE_TARBALL), BASE_IMAGE)
        try:
            yield engine
        finally:
            engine("rm", "--all", "--force")
            # The images this run replaced; the tagged ones and the build cache stay.
            engine("image", "prune", "--force", timeout=300)


@pytest.fixture(scope="module")
def make_image(podman: Podman, log_dir: Path) -> subprocess.CompletedProcess[str]:
    """`make image` with podman, on the Debian-built base (its output in make-image.log)."""
    make = shutil.which("make")
    assert make, "make is needed to run the Makefile"
    result = subprocess.run(
        [make, "-C", str(ROOT), "image", "CONTAINER_ENGINE=podman", f"BASE_IMAGE={BASE_IMAGE}"],
        env=podman.env,
        capture_output=True,
        text=True,
        check=False,
        timeout=1000,
    )
    (log_dir / "make-image.log").write_text(result.stdout + result.stderr)
    if result.returncode == 0:
        keep_build_stages(podman)
    return result


def keep_build_stages(podman: Podman) -> None:
    """Tags the last image of each named stage of the Dockerfile (all in the layer cache: no step
    runs again), so that pruning keeps them and their layers for the next run: no tag, no child
    of a tagged image, and podman image prune deletes a stage's layers, the dependencies' too."""
    stages = re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)\s*$", (ROOT / "Dockerfile").read_text(), re.M | re.I)
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    build_args = ["--build-arg", f"VERSION={version}", "--build-arg", f"BASE_IMAGE={BASE_IMAGE}"]
    for stage in stages:
        podman("build", "--quiet", "--target", stage, *build_args, "-t", f"{BUILD_CACHE}:{stage}", str(ROOT))


def test_make_image_builds_the_image_the_chart_runs(
    podman: Podman, make_image: subprocess.CompletedProcess[str]
) -> None:
    assert make_image.returncode == 0, make_image.stdout[-4000:] + make_image.stderr[-4000:]
    assert f"built {chart_image()}" in make_image.stdout
    (inspected,) = json.loads(podman("image", "inspect", chart_image()))
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert inspected["Config"]["Labels"]["org.opencontainers.image.version"] == version
    assert inspected["Config"]["User"] == "65532:65532"
    assert inspected["Config"]["Entrypoint"] == ["picker"]
    assert podman("run", "--rm", "--read-only", chart_image()).startswith("usage: picker serve")  # its CMD
    # The tokenizer extra is in (token-exact prefix hashing).
    podman("run", "--rm", "--read-only", "--entrypoint", "python", chart_image(), "-c", "import transformers")


def test_the_image_serves_probes_and_routes_as_the_chart_runs_it(
    podman: Podman, make_image: subprocess.CompletedProcess[str], log_dir: Path
) -> None:
    assert make_image.returncode == 0, "make image failed (see the test above)"
    addresses = loopback_addresses(2)
    backends = start_backends(addresses, log_dir)
    grpc_port, health_port, metrics_port = free_port(), free_port(), free_port()
    # As the chart's pod: read-only root with /tmp writable, every capability dropped, no setuid.
    argv = [podman.binary, "run", "--rm", "--name", "picker-image", "--network", "host"]
    argv += ["--read-only", "--tmpfs", "/tmp", "--cap-drop", "ALL", "--security-opt", "no-new-privileges"]
    argv += [chart_image(), "serve", "--endpoints", ",".join(addresses), "--bind-address", "127.0.0.1"]
    argv += ["--grpc-port", str(grpc_port), "--grpc-health-port", str(health_port)]
    argv += ["--metrics-port", str(metrics_port)]
    picker = ManagedProcess("picker-image", argv, log_dir, env=podman.env).start()
    envoys = []
    try:
        picker.wait_ready(lambda: serving(health_port), timeout=90)
        assert {name: health_status(health_port, name) for name in PROBED} == dict.fromkeys(PROBED, SERVING)
        # duplex is the config the chart's Envoy sidecar runs (charts/picker/envoy/gateway.yaml):
        # the standalone pair, with Envoy from the venv, as Docker Hub's Envoy image is out of reach.
        for mode in ("buffered", "duplex"):
            envoys.append(start_envoy(mode, grpc_port, log_dir, tls=True, name=f"envoy-image-{mode}"))
            answer = post_completion(envoys[-1].url + "/v1/completions")
            # The backend that answered is the one the picker in the image chose.
            assert answer["headers"]["x-gateway-destination-endpoint"] == answer["backend"], mode
            assert answer["backend"] in addresses, mode
    finally:
        for envoy in envoys:
            envoy.stop()
        picker.stop()  # SIGTERM to `podman run`, which passes it to the picker in the container
        backends.stop()
    assert picker.proc is not None and picker.proc.returncode == 0, picker.log_tail()
    assert "shutting down" in picker.log_path.read_text()
    assert podman("ps", "--all", "--quiet") == ""  # --rm removed it once the picker exited


def post_completion(url: str) -> dict[str, object]:
    body = json.dumps({"model": "m", "prompt": "hello from the image test"}).encode()
    request = urllib.request.Request(url, data=body, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200
        answer: dict[str, object] = json.loads(response.read())
        return answer
