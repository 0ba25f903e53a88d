"""What the picker shows: Prometheus metrics (`metrics`), the metrics HTTP server (`http`) and
who may read it (`access_review`: TokenReview + SubjectAccessReview), gRPC health (`health`),
logs as the reference's -v and zap flags say (`logging`), OpenTelemetry traces (`tracing`),
profiles (`profiling`) and the decision log behind /debug/decisions (`decisions`).

May import: framework, discovery (the Kubernetes API errors access reviews share with it).
"""
