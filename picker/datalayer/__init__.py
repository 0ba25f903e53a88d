"""The data layer: scrape model servers' /metrics pages into the datastore.

`engines` says which series to read per engine, `parse` reads them from a page, `collector`
runs the per-endpoint scrape loops and the pool gauges.
"""
