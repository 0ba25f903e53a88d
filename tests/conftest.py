"""Fixtures every tier shares: test binaries built from their Go modules (never a skip)."""

from __future__ import annotations

from pathlib import Path

import pytest

from picker_bench.gobuild import GoModuleUnavailableError
from picker_bench.kube_cluster import KUBE_VERSION, MissingBinaryError, cached_binary
from picker_bench.llmd import llmd_epp_binary, pd_sidecar_binary


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
