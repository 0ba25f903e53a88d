"""The reference's latency-predictor plugins, backed by the picker's own models instead of the
reference's training and prediction sidecars: per-endpoint predictions (`prediction`), the time
per output token learnt from responses (`tpot`), and the plugins (`plugins`):
`predicted-latency-producer`, `latency-scorer`, `prefix-cache-affinity-filter`,
`slo-headroom-tier-filter` and `latency-slo-admitter`; and the picker's own completion-time cost
(`e2e`, the `e2e-cost-scorer`).

May import: prefix (the TTFT model and the prefix match), framework, datastore, telemetry.
"""
