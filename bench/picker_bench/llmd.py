"""llm-d's binaries, built from the Go module `github.com/llm-d/llm-d-inference-scheduler@v0.4.0`:
its routing sidecar (`pd-sidecar`), run in front of a decode `picker sim` pod, and its scheduler
(`cmd/epp`, `llmd_epp_binary()`; `picker_bench.llmd_epp` runs it as a bench system).

In an llm-d prefill/decode fleet the sidecar is what the gateway sends a decode pod's requests
to. When the request carries `x-prefiller-host-port` (set by the EPP's `prefill-header-handler`)
it first sends the request to that prefill pod with `kv_transfer_params.do_remote_decode`,
`max_tokens: 1` and `stream: false`, then the original request to its own vLLM with the
`kv_transfer_params` the prefill pod answered (connector `nixlv2`); without the header it only
proxies to its vLLM. It reaches its vLLM at `localhost:<--vllm-port>`, so the pod must listen
on the loopback.

The sidecar is a build of the module's `cmd/pd-sidecar`: `pd_sidecar_binary()` builds it once
into the binary cache; `python -m picker_bench.llmd [pd-sidecar|llmd-epp]` builds the sidecar
(the default) or the scheduler and prints its path.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from picker_bench.gobuild import GoModule, GoModuleUnavailableError, print_built, run_niced
from picker_bench.kube_cluster import BIN_DIR
from picker_bench.process import ManagedProcess, free_port, http_ok

LLMD = GoModule("github.com/llm-d/llm-d-inference-scheduler", "v0.4.0")
# The Rust tokenizers binding llm-d's kv-cache manager v0.4.0 pins; its `cmd/epp` links its
# static library through cgo.
TOKENIZERS = GoModule("github.com/daulet/tokenizers", "v1.22.1")


def pd_sidecar_binary() -> Path:
    """llm-d's sidecar binary in the binary cache (`pd-sidecar-v0.4.0`), built from its module the
    first time (about 4 minutes of CPU on 2 cores, at the lowest priority)."""
    return LLMD.binary("./cmd/pd-sidecar", "pd-sidecar")


def tokenizers_library() -> Path:
    """The directory holding `libtokenizers.a`, the static library of the Rust crate in the Go
    module github.com/daulet/tokenizers, built the first time with cargo (its Cargo.lock, at
    the lowest priority) and cached beside the binary cache."""
    lib_dir = BIN_DIR.parent / "lib" / f"tokenizers-{TOKENIZERS.version}"
    library = lib_dir / "libtokenizers.a"
    if library.is_file():
        return lib_dir
    cargo = os.environ.get("CARGO") or shutil.which("cargo") or str(Path.home() / ".cargo" / "bin" / "cargo")
    if not os.access(cargo, os.X_OK):
        raise GoModuleUnavailableError(
            f"cargo is needed to build {TOKENIZERS.path}'s Rust library and is not installed"
        )
    lib_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib_dir) as scratch:
        crate = Path(scratch) / "crate"
        shutil.copytree(TOKENIZERS.source_dir(), crate)  # the module cache is read-only
        for path in (crate, *crate.rglob("*")):
            path.chmod(path.stat().st_mode | stat.S_IWUSR)
        # its own target directory: `make` exports CARGO_TARGET_DIR for the core's build cache
        env = {**os.environ, "CARGO_TARGET_DIR": str(crate / "target")}
        run_niced([cargo, "build", "--release", "--locked"], crate, env, "cargo build")
        partial = Path(scratch) / "libtokenizers.a"
        shutil.copy(crate / "target" / "release" / "libtokenizers.a", partial)
        # Debian's binutils load an LLVM 14 linker plugin that cannot read newer rustc's bitcode
        # sections, and the archive index then lacks Rust's std (the Go link fails with
        # undefined references to core::panicking): drop the bitcode before indexing.
        objcopy = ["objcopy", "--remove-section", ".llvmbc", "--remove-section", ".llvmcmd", str(partial)]
        run_niced(objcopy, Path(scratch), os.environ, "objcopy")
        run_niced(["ranlib", str(partial)], Path(scratch), os.environ, "ranlib")
        partial.replace(library)
    return lib_dir


def python_config(*flags: str) -> str:
    """`python3.11-config FLAGS` of the interpreter running this (whose site-packages the built
    binary's embedded Python then shares)."""
    config = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}-config"
    if not os.access(config, os.X_OK):
        raise GoModuleUnavailableError(
            f"{config} is missing: llm-d's epp embeds Python (apt-get install python3.11-dev)"
        )
    result = subprocess.run([str(config), *flags], capture_output=True, text=True, check=True)
    return result.stdout.strip()


def llmd_epp_binary() -> Path:
    """llm-d's scheduler (`cmd/epp` of its module) in the binary cache (`llmd-epp-v0.4.0`), built
    the first time: cgo with libzmq (apt-get install libzmq3-dev), this interpreter's libpython
    (its chat-template rendering) and the tokenizers library above (about 12 minutes of CPU on
    2 cores all told, at the lowest priority)."""
    binary = BIN_DIR / f"llmd-epp-{LLMD.version}"
    if os.access(binary, os.X_OK):
        return binary
    lib_dir = tokenizers_library()
    build_env = {
        "CGO_ENABLED": "1",
        "CGO_CFLAGS": python_config("--cflags"),
        "CGO_LDFLAGS": f"{python_config('--ldflags', '--embed')} -L{lib_dir} -ltokenizers -ldl -lm",
    }
    return LLMD.binary("./cmd/epp", "llmd-epp", build_env)


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


BUILDERS: dict[str, Callable[[], Path]] = {"pd-sidecar": pd_sidecar_binary, "llmd-epp": llmd_epp_binary}


def main(argv: Sequence[str] = ()) -> int:
    """`python -m picker_bench.llmd [pd-sidecar|llmd-epp]`: build the sidecar (or the scheduler)
    if it is not cached; print its path."""
    which = argv[0] if argv else "pd-sidecar"
    if which not in BUILDERS:
        print(f"picker_bench.llmd: build one of {', '.join(BUILDERS)}, not {which!r}", file=sys.stderr)
        return 2
    return print_built(BUILDERS[which], "picker_bench.llmd")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
