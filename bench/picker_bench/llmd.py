"""llm-d's routing sidecar (`pd-sidecar` v0.4.0), run in front of a decode `picker sim` pod.

In an llm-d prefill/decode fleet the sidecar is what the gateway sends a decode pod's requests
to. When the request carries `x-prefiller-host-port` (set by the EPP's `prefill-header-handler`)
it first sends the request to that prefill pod with `kv_transfer_params.do_remote_decode`,
`max_tokens: 1` and `stream: false`, then the original request to its own vLLM with the
`kv_transfer_params` the prefill pod answered (connector `nixlv2`); without the header it only
proxies to its vLLM. It reaches its vLLM at `localhost:<--vllm-port>`, so the pod must listen
on the loopback.

The binary is a build of the Go module `github.com/llm-d/llm-d-inference-scheduler@v0.4.0`'s
`cmd/pd-sidecar`: `pd_sidecar_binary()` builds it once into the binary cache;
`python -m picker_bench.llmd` does so and prints its path.
"""

from __future__ import annotations

import sys
from pathlib import Path

from picker_bench.gobuild import GoModule, print_built
from picker_bench.process import ManagedProcess, free_port, http_ok

LLMD = GoModule("github.com/llm-d/llm-d-inference-scheduler", "v0.4.0")


def pd_sidecar_binary() -> Path:
    """llm-d's sidecar binary in the binary cache (`pd-sidecar-v0.4.0`), built from its module the
    first time (about 4 minutes of CPU on 2 cores, at the lowest priority)."""
    return LLMD.binary("./cmd/pd-sidecar", "pd-sidecar")


class PdSidecar:
    """One sidecar in front of the decode pod at `localhost:<vllm_port>`, on a free port of its
    own (plain HTTP: the gateway's upstream is not TLS); `start()` returns once it answers."""

    def __init__(self, binary: Path, vllm_port: int, log_dir: Path, name: str) -> None:
        self.port = free_port()
        argv = [
            str(binary),
            "--port",
            str(self.port),
            "--vllm-port",
            str(vllm_port),
            "--connector",
            "nixlv2",
            "--secure-proxy=false",
        ]
        self.process = ManagedProcess(name, argv, log_dir)

    @property
    def address(self) -> str:
        """Where the gateway sends the decode pod's requests (`ip:port`)."""
        return f"127.0.0.1:{self.port}"

    def start(self) -> PdSidecar:
        self.process.start()
        self.wait_ready()
        return self

    def wait_ready(self) -> None:
        """Return once the started sidecar answers its health check."""
        self.process.wait_ready(lambda: http_ok(f"http://{self.address}/health"), timeout=30)

    def stop(self) -> None:
        self.process.stop()


def main() -> int:
    """`python -m picker_bench.llmd`: build the sidecar if it is not cached; print its path."""
    return print_built(pd_sidecar_binary, "picker_bench.llmd")


if __name__ == "__main__":
    sys.exit(main())
