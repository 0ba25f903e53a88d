"""Start the real pieces for integration tests: backends, the picker and Envoy."""

from __future__ import annotations

import itertools
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from picker_bench.envoy import EnvoyProcess, picker_config
from picker_bench.process import ManagedProcess, free_port, port_open

ROOT = Path(__file__).resolve().parents[1]
_hosts = itertools.count(random.randrange(10, 200))


def loopback_addresses(n: int) -> list[str]:
    """`n` distinct `127.0.0.x:port` addresses, each free right now."""
    result = []
    for _ in range(n):
        host = f"127.0.0.{next(_hosts) % 250 + 2}"
        result.append(f"{host}:{free_port(host)}")
    return result


def health_status(port: int, service: str = "", host: str = "127.0.0.1") -> int:
    with grpc.insecure_channel(f"{host}:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def serving(port: int) -> bool:
    try:
        return health_status(port) == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


@dataclass
class Picker:
    process: ManagedProcess
    grpc_port: int
    health_port: int
    metrics_port: int

    def stop(self) -> None:
        self.process.stop()


def start_backends(addresses: list[str], log_dir: Path) -> ManagedProcess:
    proc = ManagedProcess("backends", [sys.executable, "-m", "tests.backends", *addresses], log_dir)
    proc.env = None
    proc.start()
    for address in addresses:
        host, port = address.rsplit(":", 1)
        proc.wait_ready(lambda: port_open(host, int(port)), timeout=20)
    return proc


def start_picker(
    log_dir: Path, *args: str, name: str = "picker", grpc_port: int | None = None, tls: bool = True
) -> Picker:
    grpc_port = grpc_port or free_port()
    health, metrics = free_port(), free_port()
    argv = [
        sys.executable,
        "-m",
        "picker.cli",
        "serve",
        "--bind-address",
        "127.0.0.1",
        "--grpc-port",
        str(grpc_port),
        "--grpc-health-port",
        str(health),
        "--metrics-port",
        str(metrics),
        f"--secure-serving={'true' if tls else 'false'}",
        *args,
    ]
    proc = ManagedProcess(name, argv, log_dir).start()
    proc.wait_ready(lambda: serving(health) and port_open("127.0.0.1", grpc_port), timeout=30)
    return Picker(proc, grpc_port, health, metrics)


def start_envoy(mode: str, picker_port: int, log_dir: Path, tls: bool = True, name: str = "envoy") -> EnvoyProcess:
    listen = ("127.0.0.1", free_port())
    config = picker_config(mode, listen, ("127.0.0.1", picker_port), ("127.0.0.1", free_port()), tls=tls)
    envoy = EnvoyProcess(name, config, log_dir).start()
    envoy.wait_ready(envoy.ready, timeout=30)
    return envoy


@dataclass
class Stack:
    """Backends + picker + Envoy, all real processes."""

    backends: list[str]
    backend_process: ManagedProcess
    picker: Picker
    envoy: EnvoyProcess
    extra: list[ManagedProcess] = field(default_factory=list)

    def stop(self) -> None:
        for proc in (self.envoy, self.picker.process, self.backend_process, *self.extra):
            proc.stop()
