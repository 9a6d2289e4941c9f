"""What an agent's ``/metrics`` shows beyond its feed: its bytes by kind, link and queues.

The job's bytes split as the agent's ``bye`` reports them: ``ring`` (its ring's and a
star's frames), ``checkpoint`` (its model uploads and patches) and ``control`` (the
rest: hellos, acks, metrics rows, byes); the three add up to what its link published
since the job began. They restart at each new job (Prometheus' ``rate`` takes that for
a counter reset); ``fedring_link_bytes_total`` counts the daemon's whole life.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from fedring.monitor.prometheus import Probe

if TYPE_CHECKING:
    from fedring.edge_agent.daemon import AgentDaemon


def agent_probe(daemon: AgentDaemon) -> Callable[[], Probe]:
    """A probe of `daemon`, called at each scrape from the metrics server's thread."""
    info = {"role": "agent", "agent": daemon.me}

    def probe() -> Probe:
        link, endpoint, centre = daemon.link, daemon.endpoint, daemon.centre
        if link is None:
            return Probe(info=info)
        sent: dict[str, int] = {}
        if endpoint is not None:  # in a job (or after one, until the next)
            ring = endpoint.stats.bytes_sent + (centre.stats.bytes_sent if centre else 0)
            checkpoint = daemon.checkpoint_bytes - daemon.checkpoint_bytes_at_job
            job = link.stats.bytes_sent - daemon.link_bytes_at_job
            sent = {"ring": ring, "checkpoint": checkpoint,
                    "control": max(job - ring - checkpoint, 0)}  # fmt: skip
        return Probe(
            info=info, bytes_sent=sent,
            link_bytes={"sent": link.stats.bytes_sent, "received": link.stats.bytes_received},
            queues=link.queue_depths(), queued_bytes=link.queued_bytes,
        )  # fmt: skip

    return probe
