"""A real redis-server for the --state-store tests (tools/install-test-binaries.sh installs it):
on a free loopback port, in its own session, nothing persisted, stopped (or killed) by PID."""

from __future__ import annotations

import os
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path

from picker_bench.process import ManagedProcess, free_port, port_open
from picker_bench.systems import redis_argv


@dataclass
class RedisServer:
    process: ManagedProcess
    port: int
    password: str | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def kill(self) -> None:
        """SIGKILL, as a crash: clients see their connections cut."""
        os.kill(self.process.pid, signal.SIGKILL)
        assert self.process.proc is not None
        self.process.proc.wait(10)

    def stop(self) -> None:
        self.process.stop()


def start_redis(
    log_dir: Path, name: str = "redis", port: int | None = None, password: str | None = None
) -> RedisServer:
    """A redis-server on 127.0.0.1 (on `port` to restart one where its clients look for it)."""
    binary = shutil.which("redis-server")
    assert binary, "redis-server is missing: run tools/install-test-binaries.sh"
    port = port or free_port()
    process = ManagedProcess(name, redis_argv(binary, port, log_dir, name, password), log_dir).start()
    process.wait_ready(lambda: port_open("127.0.0.1", port), timeout=20)
    return RedisServer(process, port, password)
