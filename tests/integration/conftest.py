"""Fixtures that start real backends, the picker and Envoy (stopped by PID at the end)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

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
