"""The network views of a feed, started beside a job and stopped with it.

    with serving(feed, metrics_port=9100, dashboard_port=8050):
        run_the_job(feed)

`metrics_port` serves Prometheus' text format at ``/metrics``
(`fedring.monitor.prometheus`); `dashboard_port` serves the live dashboard
(`fedring.monitor.dashboard`). Both bind to `host`, loopback unless asked: a job's
metrics and members are not for every host on the network; `metrics_host` binds the
metrics elsewhere (a Prometheus on another host). `probe` adds what the runner knows
beyond the feed (`prometheus.Probe`); `metrics_hold_s` keeps ``/metrics`` up that long
after the job, so that a 15 s scrape still sees its end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING

from fedring.monitor.feed import JobFeed

if TYPE_CHECKING:
    from fedring.monitor.prometheus import Probe


@contextmanager
def serving(feed: JobFeed, *, metrics_port: int | None = None,
            dashboard_port: int | None = None, host: str = "127.0.0.1",
            metrics_host: str | None = None, probe: Callable[[], Probe] | None = None,
            metrics_hold_s: float = 0.0) -> Iterator[None]:  # fmt: skip
    with ExitStack() as stack:
        if metrics_port is not None:
            from fedring.monitor.prometheus import metrics_server

            stack.enter_context(metrics_server(feed, metrics_port, metrics_host or host,
                                               probe=probe, hold_s=metrics_hold_s))  # fmt: skip
        if dashboard_port is not None:
            from fedring.monitor.dashboard import dashboard_server

            stack.enter_context(dashboard_server(feed, dashboard_port, host))
        yield
