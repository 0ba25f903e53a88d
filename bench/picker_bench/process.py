"""Child processes the harness (and the tests) start and must always stop."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]  # an AF_INET address is a (host, port) tuple
        return port


def wait_until(condition: Callable[[], bool], timeout: float, what: str, interval: float = 0.02) -> None:
    """Poll `condition` until it holds; raise TimeoutError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.1f}s waiting for {what}")
        time.sleep(interval)


def port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


def http_ok(url: str) -> bool:
    """Whether a GET of `url` answers 200 within a second."""
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            status: int = r.status
            return status == 200
    except OSError:
        return False


class ManagedProcess:
    """A daemon in its own session, logged to a file, stopped by PID (and its group)."""

    def __init__(
        self, name: str, argv: Sequence[str], log_dir: Path, env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = Path(log_dir) / f"{name}.log"
        self.env = env
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ManagedProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_ready(self, condition: Callable[[], bool], timeout: float = 30.0) -> None:
        """Wait for `condition`, failing fast (with the log) if the process dies first."""

        def ready() -> bool:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited early:\n{self.log_tail()}")
            return condition()

        try:
            wait_until(ready, timeout, f"{self.name} to become ready")
        except TimeoutError as e:
            raise TimeoutError(f"{e}\n{self.log_tail()}") from None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the process group, then SIGKILL what is left after `timeout`."""
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def __enter__(self) -> ManagedProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def health_serving(host: str, port: int) -> bool:
    """Whether the gRPC health service at host:port answers SERVING (for the whole server: "")."""
    with grpc.insecure_channel(f"{host}:{port}") as channel:
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError:
            return False
    return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)
