"""Model servers' KV-cache events: vLLM's wire format (`decode`), the ZMQ `subscriber`, the
precise index it feeds (`precise`) and the `precise-prefix-cache-scorer` plugin.

May import: prefix (block hashes, the prefix producer's keys), framework, datastore, telemetry.
"""
