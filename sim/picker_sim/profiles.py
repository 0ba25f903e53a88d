"""Timing profiles: how long one engine step takes for a given batch.

step = step_overhead
     + prefill_tokens  x prefill_per_token   (only uncached prompt tokens are scheduled)
     + decode_seqs     x decode_per_seq
     + context_tokens  x context_per_token   (KV read by attention, all running sequences)

A KV transfer between engines (prefill/decode disaggregation, vLLM's NixlConnector) takes
tokens x kv_bytes_per_token / kv_transfer_bandwidth, overlapping the engine's steps.

Sources and derivations:

* `llama3-8b-h100` (Llama-3.1-8B BF16, one H100 SXM 80 GB):
  - decode step at batch 1 about 6.5 ms: the 16 GB of weights read at the H100's 3.35 TB/s
    HBM3 bandwidth take ~4.8 ms, plus kernel launch/sampling overhead; llm-d-inference-sim's
    reference values (peers.md §2) give ITL 10-15 ms for 7-8B on H100 through an HTTP server.
  - prefill ~12,500 tokens/s (0.08 ms/token): 2 x 8e9 FLOP/token at ~200 TFLOP/s achieved
    BF16; TTFT for a 256-token prompt = 6.5 + 20 ms plus queueing, inside the 60-120 ms
    llm-d-inference-sim quotes end to end.
  - context_per_token 0.039 us: Llama-3-8B keeps 128 KiB of KV per token (32 layers x 8 KV
    heads x 128 dims x K,V x 2 bytes), read once per step at 3.35 TB/s.
  - KV capacity: (80 GB x 0.9 - 16 GB weights) / 128 KiB ~ 427k tokens -> 26,700 blocks of 16.
  - KV transfer: NIXL reads the prefill GPU's blocks over one 400 Gb/s RDMA NIC (ConnectX-7,
    ~50 GB/s): 1,000 tokens (128 MB) in ~2.6 ms.
* `llama3-70b-h100-tp4` (Llama-3.1-70B BF16, 4 x H100, tensor parallel): 140 GB of weights over
  4 x 3.35 TB/s -> ~10.5 ms + all-reduce overhead -> ~25 ms ITL, inside the 25-40 ms that
  llm-d-inference-sim quotes for 70B TP4/H100; prefill ~4,000 tokens/s (2 x 70e9 FLOP/token at
  ~560 TFLOP/s over 4 GPUs); KV 320 KiB/token (80 layers x 8 heads x 128 x 2 x 2 B), split over
  4 GPUs; capacity (320 GB x 0.9 - 140 GB) / 320 KiB ~ 460k tokens (llm-d's benchmark measured
  461,376 tokens per pod, peers.md §9) -> 28,800 blocks. KV transfer: each of the 4 GPUs reads
  its shard over its own 400 Gb/s NIC, 4 x 50 GB/s.
* `tiny`: a toy profile for tests (1 ms steps, fast prefill, 512 blocks, 4 KiB of KV per token
  over 1 GB/s: 1,000 tokens transfer in ~4 ms).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Profile:
    """Per-step cost coefficients (seconds) and the engine's default sizes."""

    name: str
    step_overhead: float
    prefill_per_token: float
    decode_per_seq: float
    context_per_token: float
    lora_load: float  # seconds to load one adapter
    num_gpu_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_bytes_per_token: int  # the model's KV cache per token, all layers, K and V
    kv_transfer_bandwidth: float  # bytes per second between two engines' KV caches

    def step_time(self, prefill_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        """Simulated seconds one engine step takes."""
        return (
            self.step_overhead
            + prefill_tokens * self.prefill_per_token
            + decode_seqs * self.decode_per_seq
            + context_tokens * self.context_per_token
        )

    def transfer_time(self, tokens: int) -> float:
        """Simulated seconds moving `tokens` tokens of KV cache from one engine to another."""
        return tokens * self.kv_bytes_per_token / self.kv_transfer_bandwidth


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile(
            name="llama3-8b-h100",
            step_overhead=0.0065,
            prefill_per_token=0.00008,
            decode_per_seq=0.00005,
            context_per_token=0.039e-6,
            lora_load=0.025,
            num_gpu_blocks=26_700,
            max_num_seqs=256,
            max_num_batched_tokens=8192,
            kv_bytes_per_token=131_072,
            kv_transfer_bandwidth=50e9,
        ),
        Profile(
            name="llama3-70b-h100-tp4",
            step_overhead=0.025,
            prefill_per_token=0.00025,
            decode_per_seq=0.0001,
            context_per_token=0.024e-6,
            lora_load=0.08,
            num_gpu_blocks=28_800,
            max_num_seqs=256,
            max_num_batched_tokens=8192,
            kv_bytes_per_token=327_680,
            kv_transfer_bandwidth=200e9,
        ),
        Profile(
            name="tiny",
            step_overhead=0.001,
            prefill_per_token=0.00002,
            decode_per_seq=0.00001,
            context_per_token=0.0,
            lora_load=0.005,
            num_gpu_blocks=512,
            max_num_seqs=16,
            max_num_batched_tokens=2048,
            kv_bytes_per_token=4096,
            kv_transfer_bandwidth=1e9,
        ),
    )
}
DEFAULT_PROFILE = "llama3-8b-h100"


def get_profile(name: str) -> Profile:
    """The named profile; ValueError listing the known names otherwise."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; known: {', '.join(sorted(PROFILES))}") from None
