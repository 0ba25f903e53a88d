"""What the picker shows: Prometheus metrics (`metrics`), the metrics HTTP server (`http`), gRPC
health (`health`), logs as the reference's -v and zap flags say (`logging`) and the decision
log behind /debug/decisions (`decisions`).

May import: framework.
"""
