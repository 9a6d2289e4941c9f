"""What the coordinator's ``/metrics`` shows beyond its feed: link bytes, queues, re-formations.

`cli_mqtt` makes a `RunnerProbe` before the runner exists (the endpoint starts first,
so that enrolment is seen) and hands it the runner once made; until then, and for a
runner without a link yet, a scrape gets only the coordinator's role.
"""

from __future__ import annotations

from typing import Any

from fedring.monitor.prometheus import Probe


class RunnerProbe:
    """Called at each scrape, from the metrics server's thread: reads, never writes."""

    def __init__(self) -> None:
        self.runner: Any = None  # a `Coordinator` or a `PipelineCoordinator`

    def __call__(self) -> Probe:
        runner = self.runner
        link = getattr(runner, "link", None)
        epochs = getattr(runner, "epochs", None)  # the ring's re-formations so far
        if link is None:
            return Probe(info={"role": "coordinator"},
                         reformations=epochs if isinstance(epochs, int) else None)  # fmt: skip
        return Probe(
            info={"role": "coordinator"},
            link_bytes={"sent": link.stats.bytes_sent, "received": link.stats.bytes_received},
            queues=link.queue_depths(), queued_bytes=link.queued_bytes,
            reformations=epochs if isinstance(epochs, int) else None,
        )  # fmt: skip
