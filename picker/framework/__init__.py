"""The plugin framework: interfaces (`plugin`), the per-request `CycleState` with typed keys,
`Handle` and persistent objects, the `Registry`, strict `Parameters` and the Go-duration parser.

Owns no plugin. May import: datastore (endpoint values) only.
"""
