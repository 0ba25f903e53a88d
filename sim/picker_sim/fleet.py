"""A fleet of simulated pods sharing one event loop and one ZMQ context."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

import zmq.asyncio

from picker.kvevents.vllm_hash import DEFAULT_SEED
from picker.prefix.builtin_tokenizer import Tokenizer, load_tokenizer
from picker_sim.engine import EngineConfig
from picker_sim.events import DEFAULT_TOPIC
from picker_sim.faults import Faults
from picker_sim.kvcache import HASH_ALGORITHMS
from picker_sim.kvtransfer import ROLES
from picker_sim.pod import Pod
from picker_sim.profiles import DEFAULT_PROFILE, get_profile


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """Everything that shapes a fleet; `None` sizes come from the profile."""

    pods: int = 1
    host: str = "127.0.0.1"
    base_port: int = 0  # 0 = every pod picks a free port
    distinct_hosts: bool = False  # pod i on host+i (an IPv4 address), all on base_port
    kv_events_base_port: int | None = None  # None = no KV events; 0 = free ports
    kv_replay_base_port: int | None = None  # None = no replay socket; 0 = free ports
    kv_events_format: str = "array"
    kv_events_connect: str | None = None  # every pod's PUB socket connects here instead of binding
    kv_events_topic: str = DEFAULT_TOPIC
    block_hash: str = "sha256_cbor"  # vLLM's --prefix-caching-hash-algo, or "builtin"
    hash_seed: str = DEFAULT_SEED  # vLLM's PYTHONHASHSEED
    model: str = "sim-model"
    profile: str = DEFAULT_PROFILE
    time_scale: float = 1.0
    num_gpu_blocks: int | None = None
    block_size: int = 16
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int = 32768
    max_loras: int = 0
    lora_modules: tuple[str, ...] = ()
    tokenizer: str = "builtin"
    faults: Faults = field(default_factory=Faults)
    name_prefix: str = "sim"
    roles: tuple[str, ...] = ()  # pod i's P/D role; () = every pod `both`
    kv_transfer_timeout: float = 480.0  # seconds a prefill's pinned blocks wait for pickup

    def role(self, i: int) -> str:
        """Pod i's prefill/decode role."""
        return self.roles[i] if self.roles else "both"

    def engine_config(self) -> EngineConfig:
        profile = get_profile(self.profile)
        if self.time_scale <= 0:
            raise ValueError("time_scale must be positive")
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        if self.roles and len(self.roles) != self.pods:
            raise ValueError(f"{len(self.roles)} roles for {self.pods} pods")
        if unknown := set(self.roles) - set(ROLES):
            raise ValueError(f"unknown roles {sorted(unknown)}; known: {', '.join(ROLES)}")
        if self.kv_transfer_timeout <= 0:
            raise ValueError("kv_transfer_timeout must be positive")
        if self.block_hash not in HASH_ALGORITHMS:
            raise ValueError(f"block hash must be one of {HASH_ALGORITHMS}, not {self.block_hash!r}")
        return EngineConfig(
            profile=profile,
            num_gpu_blocks=self.num_gpu_blocks or profile.num_gpu_blocks,
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs or profile.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens or profile.max_num_batched_tokens,
            max_loras=self.max_loras,
            max_model_len=self.max_model_len,
            time_scale=self.time_scale,
            kv_transfer_timeout=self.kv_transfer_timeout,
            block_hash=self.block_hash,
            hash_seed=self.hash_seed,
        )


def _port(base: int | None, i: int) -> int | None:
    if base is None:
        return None
    return 0 if base == 0 else base + i


class Fleet:
    """Simulated pods inside the current process (see the package docstring for an example)."""

    def __init__(self, config: FleetConfig | None = None, tokenizer: Tokenizer | None = None) -> None:
        self.config = config or FleetConfig()
        self.engine_config = self.config.engine_config()
        self.tokenizer = tokenizer or load_tokenizer(self.config.tokenizer)
        self.pods: list[Pod] = []
        self._zmq: zmq.asyncio.Context | None = None

    def _pod_host(self, i: int) -> str:
        if not self.config.distinct_hosts:
            return self.config.host
        return str(ipaddress.IPv4Address(self.config.host) + i)

    async def start(self) -> None:
        """Start every pod; on failure stop the ones already started and re-raise."""
        cfg = self.config
        if cfg.kv_events_base_port is not None or cfg.kv_events_connect is not None:
            self._zmq = zmq.asyncio.Context()
        try:
            for i in range(cfg.pods):
                distinct = cfg.distinct_hosts
                pod = Pod(
                    name=f"{cfg.name_prefix}-{i}",
                    host=self._pod_host(i),
                    port=cfg.base_port if distinct else (_port(cfg.base_port, i) or 0),
                    model=cfg.model,
                    engine_config=self.engine_config,
                    tokenizer=self.tokenizer,
                    zmq_ctx=self._zmq,
                    kv_events_port=cfg.kv_events_base_port if distinct else _port(cfg.kv_events_base_port, i),
                    kv_replay_port=cfg.kv_replay_base_port if distinct else _port(cfg.kv_replay_base_port, i),
                    kv_events_format=cfg.kv_events_format,
                    kv_events_connect=cfg.kv_events_connect,
                    kv_events_topic=cfg.kv_events_topic,
                    lora_modules=cfg.lora_modules,
                    faults=Faults(**cfg.faults.as_dict()),
                    role=cfg.role(i),
                )
                self.pods.append(pod)
                await pod.start()
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        """Stop every pod and close the ZMQ context."""
        for pod in self.pods:
            await pod.stop()
        self.pods = []
        if self._zmq is not None:
            self._zmq.term()
            self._zmq = None

    async def __aenter__(self) -> Fleet:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
