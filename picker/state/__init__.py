"""State sync: what a pick teaches one picker process (approximate prefix-index inserts) is
published to the others, workers and replicas alike, through a Redis/Valkey stream, and applied
to their local state (`sync`); the request path only enqueues. `url` parses `--state-store`,
`messages` encodes the versioned protobuf schema of proto/ (generated code in `v1`).

May import: datastore, telemetry.
"""
