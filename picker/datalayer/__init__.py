"""The data layer: scrape model servers' /metrics pages into the datastore.

`engines` says which series to read per engine, `parse` reads them from a page, `collector`
runs the per-endpoint scrape loops and the pool gauges, `layer` rebuilds the collector when the
installed config's data sources change, `plugins` are the config's data-layer plugins.

May import: framework, datastore, telemetry.
"""
