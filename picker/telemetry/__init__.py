"""What the picker shows: Prometheus metrics (`metrics`), the metrics HTTP server (`http`), gRPC
health (`health`) and the decision log behind /debug/decisions (`decisions`).

May import: framework.
"""
