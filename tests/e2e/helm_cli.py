"""Running the helm binary in e2e tests."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from picker_bench.kube_cluster import KubeCluster

# The helm tools/install-test-binaries.sh installs (the same default, the same variable).
HELM_VERSION = os.environ.get("HELM_VERSION", "v3.19.0")


def helm(helm_binary: Path, helm_env: dict[str, str], *args: str, kube: KubeCluster | None = None) -> str:
    """Run helm; on failure the assertion shows its stderr."""
    command = [str(helm_binary), *args]
    if kube is not None:
        command += ["--kubeconfig", str(kube.admin_kubeconfig)]
    result = subprocess.run(command, env=helm_env, capture_output=True, text=True, check=False, timeout=120)
    assert result.returncode == 0, f"helm {' '.join(args)} failed:\n{result.stderr}\n{result.stdout}"
    return result.stdout
