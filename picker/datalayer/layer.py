"""The data layer as the installed config describes it: one collector, rebuilt on reload when
the config's data sources change (and stopped when `dataLayer.sources: []` turns it off)."""

from __future__ import annotations

from picker.datalayer.collector import MetricsCollector
from picker.datalayer.plugins import ScrapeSettings
from picker.datastore.store import Datastore


class DataLayer:
    """Owns the metrics collector; `apply` makes it follow the config's `ScrapeSettings`.

    The server-wide knobs (`interval`, `staleness_threshold`, pool gauges) come from flags;
    what is scraped and read comes from the config.
    """

    def __init__(
        self,
        datastore: Datastore,
        *,
        interval: float,
        staleness_threshold: float,
        pool_gauges_interval: float,
        pool_name: str,
    ) -> None:
        self.datastore = datastore
        self.interval = interval
        self.staleness_threshold = staleness_threshold
        self.pool_gauges_interval = pool_gauges_interval
        self.pool_name = pool_name
        self.settings: ScrapeSettings | None = None
        self.collector: MetricsCollector | None = None

    async def apply(self, settings: ScrapeSettings | None) -> None:
        """Scrape as `settings` say (None: not at all); unchanged settings keep the collector."""
        if self.collector is not None and settings == self.settings:
            return
        await self.stop()
        self.settings = settings
        if settings is None:
            return
        self.collector = MetricsCollector(
            self.datastore,
            interval=self.interval,
            staleness_threshold=self.staleness_threshold,
            pool_gauges_interval=self.pool_gauges_interval,
            pool_name=self.pool_name,
            path=settings.path,
            scheme=settings.scheme,
            insecure_skip_verify=settings.insecure_skip_verify,
            engines=settings.engines,
            metrics_port=settings.port,
        )
        await self.collector.start()

    async def stop(self) -> None:
        """Stop the collector, if any."""
        collector, self.collector = self.collector, None
        if collector is not None:
            await collector.stop()
