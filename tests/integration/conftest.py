"""Fixtures that start real backends, the picker and Envoy (stopped by PID at the end)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

from picker_bench.gobuild import GoModuleUnavailableError
from picker_bench.kube_cluster import KUBE_VERSION, MissingBinaryError, cached_binary
from picker_bench.llmd import llmd_epp_binary, pd_sidecar_binary
from tests.stack import Stack, loopback_addresses, start_backends, start_envoy, start_picker


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def backends(log_dir: Path) -> Iterator[tuple[list[str], object]]:
    addresses = loopback_addresses(3)
    proc = start_backends(addresses, log_dir)
    yield addresses, proc
    proc.stop()


@pytest.fixture(scope="module", params=["duplex", "buffered"])
def stack(request: pytest.FixtureRequest, backends, log_dir: Path) -> Iterator[Stack]:
    addresses, proc = backends
    mode = request.param
    picker = start_picker(
        log_dir, "--endpoints", ",".join(addresses), "--max-body-bytes", str(3 << 20), name=f"picker-{mode}"
    )
    try:
        envoy = start_envoy(mode, picker.grpc_port, log_dir, name=f"envoy-{mode}")
    except Exception:
        picker.stop()
        raise
    s = Stack(addresses, proc, picker, envoy)
    s.mode = mode  # type: ignore[attr-defined]
    yield s
    envoy.stop()
    picker.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """A client session without a connection limit (a module may define its own `http`)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        yield session


@pytest.fixture(scope="session")
def sidecar_binary() -> Path:
    """llm-d's pd-sidecar, built from its Go module the first time (about 4 minutes of CPU on 2
    cores; tools/install-test-binaries.sh builds it before the suite)."""
    try:
        return pd_sidecar_binary()
    except GoModuleUnavailableError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def llmd_binary() -> Path:
    """llm-d's scheduler, built from its Go module the first time (about 20 minutes of CPU on 2
    cores: the Rust tokenizers library, then the Go build; tools/install-test-binaries.sh builds
    it before the suite), with the kube-apiserver it runs over."""
    try:
        cached_binary("kube-apiserver", KUBE_VERSION)
        return llmd_epp_binary()
    except (MissingBinaryError, GoModuleUnavailableError) as exc:
        pytest.fail(str(exc), pytrace=False)
