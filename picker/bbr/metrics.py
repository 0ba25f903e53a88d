"""The reference BBR's metrics (`bbr_*`), on the process's default registry."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

SUCCESS = Counter("bbr_success", "Count of time the request was processed successfully.")
INFO = Gauge("bbr_info", "General information of the current build of BBR.", ["commit", "build_ref"])
