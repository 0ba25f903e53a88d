"""Prefix-cache affinity: tokenization and chat templates (`tokenizer`, `builtin_tokenizer`,
`token_cache`), block hashing (`hashing`, `chars`, `prompt_blocks`), the approximate index
(`index`), the TTFT cost model (`ttft`), the hot-spot bound (`hotspot`) and their plugins.

May import: framework, scheduling (scorer base), request (response text), datastore, telemetry.
Never kvevents or sim.
"""
