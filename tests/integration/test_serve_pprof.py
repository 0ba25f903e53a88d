"""`--enable-pprof`: the profiling handlers on a running picker's metrics port, and their absence
without the flag (the picker's default)."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path

from tests.stack import loopback_addresses, start_picker


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as error:
        return int(error.code), error.read().decode()


def test_pprof_serves_a_sampling_profile_and_all_stacks_when_enabled(log_dir: Path) -> None:
    (address,) = loopback_addresses(1)
    picker = start_picker(log_dir, "--endpoints", address, "--enable-pprof", name="picker-pprof", tls=False)
    try:
        status, index = get(picker.metrics_port, "/debug/pprof/")
        assert status == 200 and "profile?seconds=N" in index and "goroutine" in index

        status, stacks = get(picker.metrics_port, "/debug/pprof/goroutine")
        assert status == 200
        assert "[MainThread daemon=False]" in stacks
        assert "picker/serve/__init__.py" in stacks  # the event loop thread runs the server
        assert "asyncio tasks" in stacks and "task " in stacks

        status, profile = get(picker.metrics_port, "/debug/pprof/profile?seconds=1")
        assert status == 200
        samples = {line.rsplit(" ", 1)[0]: int(line.rsplit(" ", 1)[1]) for line in profile.splitlines()}
        main = sum(n for stack, n in samples.items() if stack.startswith("MainThread;"))
        assert 0 < main <= 110  # sampled, at 100 Hz for 1 s at most (fewer when the machine is loaded)
        assert any("main (" in stack and "picker/serve/__init__.py" in stack for stack in samples)

        for bad in ("0", "-1", "301", "soon"):
            status, message = get(picker.metrics_port, f"/debug/pprof/profile?seconds={bad}")
            assert status == 400 and "seconds" in message
    finally:
        picker.stop()


def test_pprof_is_absent_by_default(log_dir: Path) -> None:
    (address,) = loopback_addresses(1)
    picker = start_picker(log_dir, "--endpoints", address, name="picker-no-pprof", tls=False)
    try:
        for path in ("/debug/pprof/", "/debug/pprof/profile?seconds=1", "/debug/pprof/goroutine"):
            assert get(picker.metrics_port, path)[0] == 404
        assert get(picker.metrics_port, "/metrics")[0] == 200
    finally:
        picker.stop()
