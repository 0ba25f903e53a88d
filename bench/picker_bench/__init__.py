"""`picker bench` and `picker demo` (workloads, systems under test, load generator, reports,
bounds) and the component benchmarks (`python -m picker_bench.prefix|kvevents|datalayer|
scheduling|overhead`), with their fixtures (`metric_pages`).

A distribution of its own (`bench/`, `picker-bench`), outside the product's wheel and image.
May import: anything; picker never imports the bench.
"""
