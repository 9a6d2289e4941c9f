"""The network views of a feed, started beside a job and stopped with it.

    with serving(feed, metrics_port=9100, dashboard_port=8050):
        run_the_job(feed)

`metrics_port` serves Prometheus' text format at ``/metrics``
(`fedring.monitor.prometheus`); `dashboard_port` serves the live dashboard
(`fedring.monitor.dashboard`). Both bind to `host`, loopback unless asked: a job's
metrics and members are not for every host on the network.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from fedring.monitor.feed import JobFeed


@contextmanager
def serving(feed: JobFeed, *, metrics_port: int | None = None,
            dashboard_port: int | None = None, host: str = "127.0.0.1") -> Iterator[None]:  # fmt: skip
    with ExitStack() as stack:
        if metrics_port is not None:
            from fedring.monitor.prometheus import metrics_server

            stack.enter_context(metrics_server(feed, metrics_port, host))
        if dashboard_port is not None:
            from fedring.monitor.dashboard import dashboard_server

            stack.enter_context(dashboard_server(feed, dashboard_port, host))
        yield
