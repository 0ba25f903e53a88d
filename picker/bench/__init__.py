"""`picker bench` and `picker demo` (workloads, systems under test, load generator, reports,
bounds) and the component benchmarks (`python -m picker.bench.prefix|kvevents|datalayer|
scheduling|overhead`), with their fixtures (`metric_pages`).

May import: anything; nothing in the serving packages imports it.
"""
