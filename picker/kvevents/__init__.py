"""Model servers' KV-cache events: vLLM wire format (decode, encode), the ZMQ subscriber that
feeds the precise prefix index (`picker.prefix.precise`), and its scorer plugin."""
