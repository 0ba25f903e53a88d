"""`picker sim`: run a fleet of simulated vLLM pods until SIGTERM/SIGINT.

Once every pod listens it prints, flushed, one line per pod
`pod <name> http://<ip>:<port>[ kv-events tcp://<ip>:<q>][ replay tcp://<ip>:<r>] role <role>`
and then `ready`. The role (`prefill`, `decode`, `both`) is what a Kubernetes pod of the fleet
would carry as its `llm-d.ai/role` label.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import signal
import sys

import uvloop

from picker.kvevents.vllm_hash import DEFAULT_SEED
from picker_sim.events import DEFAULT_TOPIC, FORMATS, binds
from picker_sim.faults import Faults
from picker_sim.fleet import Fleet, FleetConfig
from picker_sim.kvcache import HASH_ALGORITHMS
from picker_sim.kvtransfer import ROLES
from picker_sim.pod import Pod
from picker_sim.profiles import DEFAULT_PROFILE, PROFILES


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="picker sim", description="Run simulated vLLM-compatible model servers.")
    p.add_argument("--pods", type=int, default=1, help="number of simulated pods (default 1)")
    p.add_argument("--host", default="127.0.0.1", help="IPv4 address to bind (default 127.0.0.1)")
    p.add_argument("--base-port", type=int, default=8000, help="pod i listens on base-port+i (0 = free ports)")
    p.add_argument("--distinct-hosts", action="store_true", help="pod i on address host+i, all at base-port")
    p.add_argument("--kv-events-base-port", type=int, help="publish KV events; pod i on this port+i")
    p.add_argument("--kv-events-replay-base-port", type=int, help="serve KV-event replay; pod i on this port+i")
    p.add_argument(
        "--kv-events-endpoint",
        help="vLLM's kv-events endpoint: with '*' (tcp://*:PORT) every pod binds its own address at PORT "
        "(+i, as --kv-events-base-port), otherwise every pod connects to it (a subscriber that binds)",
    )
    p.add_argument(
        "--kv-events-topic",
        default=DEFAULT_TOPIC,
        help="topic of each pod's events; {ip}, {port}, {model}, {name} are filled in (default %(default)s)",
    )
    p.add_argument(
        "--kv-events-format",
        choices=FORMATS,
        default="array",
        help="event encoding: array (vLLM v0.10.2-v0.11.0, 6-field BlockStored; default), positional "
        "(7 fields, with lora_name), map (vLLM's current tagged maps)",
    )
    p.add_argument(
        "--prefix-caching-hash-algo",
        choices=HASH_ALGORITHMS,
        default="sha256_cbor",
        help="block hash, as vLLM's flag of that name, or the sim's own xxh3 chain (builtin)",
    )
    p.add_argument(
        "--hash-seed",
        default=os.environ.get("PYTHONHASHSEED", DEFAULT_SEED),
        help="seed of vLLM's NONE_HASH (vLLM's PYTHONHASHSEED; default $PYTHONHASHSEED, else %(default)s)",
    )
    p.add_argument("--model", default="sim-model", help="served model name (default sim-model)")
    p.add_argument("--profile", default=DEFAULT_PROFILE, choices=sorted(PROFILES), help="timing profile")
    p.add_argument("--time-scale", type=float, default=1.0, help="run simulated time this many times faster")
    p.add_argument("--num-gpu-blocks", type=int, help="KV blocks per pod (default from the profile)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--max-num-seqs", type=int, help="concurrent running requests per pod")
    p.add_argument("--max-num-batched-tokens", type=int, help="token budget per engine step")
    p.add_argument("--max-model-len", type=int, default=32768, help="prompt + output token limit")
    p.add_argument("--tokenizer", default="builtin", help="'builtin' or a local Hugging Face tokenizer directory")
    p.add_argument("--max-loras", type=int, default=0, help="adapters resident at once (0 = LoRA off)")
    p.add_argument("--lora-modules", nargs="*", default=[], help="adapter names served besides <model>-lora-*")
    pd = p.add_argument_group("prefill/decode disaggregation (vLLM's NixlConnector protocol: kv_transfer_params)")
    pd.add_argument("--role", choices=ROLES, default="both", help="every pod's role (label llm-d.ai/role)")
    pd.add_argument("--pd", metavar="P:D", help="P prefill pods then D decode pods (instead of --pods and --role)")
    pd.add_argument(
        "--kv-transfer-timeout",
        type=float,
        default=480.0,
        help="simulated seconds a prefill's blocks stay pinned for pickup (VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480)",
    )
    faults = p.add_argument_group("faults (also switchable at run time: POST /sim/fault)")
    faults.add_argument("--error-rate", type=float, default=0.0, help="fraction of requests that fail")
    faults.add_argument("--error-status", type=int, default=500, help="status of those failures")
    faults.add_argument("--metrics-delay", type=float, default=0.0, help="seconds added to each /metrics")
    faults.add_argument("--metrics-garbage", action="store_true", help="/metrics answers garbage")
    faults.add_argument("--hang", action="store_true", help="pods accept connections but never answer")
    faults.add_argument("--drop-kv-events", type=float, default=0.0, help="fraction of event batches dropped")
    p.add_argument("--self-bench", action="store_true", help="run the CPU self-benchmark instead (see selfbench)")
    return p


def _pd_roles(args: argparse.Namespace) -> tuple[str, ...]:
    """Each pod's role from `--pd P:D` (which then sets the pod count) or `--role`."""
    if args.pd is None:
        role: str = args.role
        pods: int = args.pods
        return (role,) * pods
    if args.role != "both":
        raise ValueError("--pd and --role exclude each other")
    prefill, sep, decode = args.pd.partition(":")
    if not sep or not prefill.isdigit() or not decode.isdigit() or int(prefill) + int(decode) < 1:
        raise ValueError(f"--pd must be P:D, counts of prefill and decode pods, not {args.pd!r}")
    if args.pods not in (1, int(prefill) + int(decode)):
        raise ValueError(f"--pods {args.pods} disagrees with --pd {args.pd}")
    return ("prefill",) * int(prefill) + ("decode",) * int(decode)


def config_from_args(args: argparse.Namespace) -> FleetConfig:
    """Validate the parsed flags into a FleetConfig; ValueError with a readable message."""
    roles = _pd_roles(args)
    if args.pods < 1:
        raise ValueError("--pods must be at least 1")
    try:
        ipaddress.IPv4Address(args.host)
    except ValueError:
        raise ValueError(f"--host must be an IPv4 address, not {args.host!r}") from None
    for name in ("base_port", "kv_events_base_port", "kv_events_replay_base_port"):
        value = getattr(args, name)
        if value is not None and not 0 <= value <= 65535:
            raise ValueError(f"--{name.replace('_', '-')} must be a port number")
    connect = None
    if args.kv_events_endpoint is not None:
        endpoint = args.kv_events_endpoint
        if binds(endpoint):
            host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
            if host != "*" or not port.isdigit() or args.kv_events_base_port is not None:
                raise ValueError("--kv-events-endpoint binds only as tcp://*:PORT, without --kv-events-base-port")
            args.kv_events_base_port = int(port)
        elif endpoint.startswith("tcp://"):
            connect = endpoint
        else:
            raise ValueError(f"--kv-events-endpoint must be a tcp:// endpoint, not {endpoint!r}")
    for name in ("num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    if args.max_loras < 0:
        raise ValueError("--max-loras must not be negative")
    faults = Faults()
    faults.update(
        {
            "error_rate": args.error_rate,
            "error_status": args.error_status,
            "metrics_delay": args.metrics_delay,
            "metrics_garbage": args.metrics_garbage,
            "hang": args.hang,
            "drop_kv_events": args.drop_kv_events,
        }
    )
    config = FleetConfig(
        pods=len(roles),
        host=args.host,
        base_port=args.base_port,
        distinct_hosts=args.distinct_hosts,
        kv_events_base_port=args.kv_events_base_port,
        kv_replay_base_port=args.kv_events_replay_base_port,
        kv_events_format=args.kv_events_format,
        kv_events_connect=connect,
        kv_events_topic=args.kv_events_topic,
        block_hash=args.prefix_caching_hash_algo,
        hash_seed=args.hash_seed,
        model=args.model,
        profile=args.profile,
        time_scale=args.time_scale,
        num_gpu_blocks=args.num_gpu_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        max_loras=args.max_loras,
        lora_modules=tuple(args.lora_modules),
        tokenizer=args.tokenizer,
        faults=faults,
        roles=roles,
        kv_transfer_timeout=args.kv_transfer_timeout,
    )
    config.engine_config()  # validates profile, sizes and time scale
    return config


def pod_line(pod: Pod) -> str:
    """The line `picker sim` prints for one started pod."""
    line = f"pod {pod.name} {pod.url}"
    if pod.kv_events_endpoint:
        line += f" kv-events {pod.kv_events_endpoint}"
    if pod.kv_replay_endpoint:
        line += f" replay {pod.kv_replay_endpoint}"
    return f"{line} role {pod.role}"


async def _serve(config: FleetConfig) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        fleet = Fleet(config)
        await fleet.start()
    except (OSError, ValueError) as exc:
        print(f"picker sim: {exc}", file=sys.stderr)
        return 1
    try:
        sys.stdout.write("".join(pod_line(p) + "\n" for p in fleet.pods) + "ready\n")
        sys.stdout.flush()
        await stop.wait()
    finally:
        await fleet.stop()
    return 0


def main(argv: list[str]) -> int:
    """Entry point of `picker sim`."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.self_bench:
        from picker_sim import selfbench

        return selfbench.main([])
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"picker sim: {exc}", file=sys.stderr)
        return 2
    return uvloop.run(_serve(config))
