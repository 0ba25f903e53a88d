"""llm-d's prefill/decode (P/D) disaggregation and data-parallel routing: its profile handlers
and the request headers that name the prefill pod or the data-parallel rank (the role filters
are in `picker.scheduling.labels`).

May import: framework, datastore, prefix, request (errors), telemetry.
"""
