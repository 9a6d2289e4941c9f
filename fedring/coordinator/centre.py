"""The coordinator as the centre of a star job (``topology = "star"``, median, trimmed).

Agents send their compressed update for each round to the coordinator, which
combines them by the job's rule (`engine.centre`, the code `fedring simulate`
runs) and sends every agent the same result. Those frames travel on a private
endpoint of the job's star topic (`topics.star`), apart from the coordinator's
control messages; each epoch runs the centre on a thread of its own, over a
channel named like the agents' (``JOB.eN``) and signed with the job's key.

The centre stops when the epoch does: a re-formation or the end of the job
interrupts it, and the next epoch starts another from the checkpoint's round.
"""

from __future__ import annotations

import logging
import threading

from fedring import build
from fedring.collective.channel import PeerChannel
from fedring.config import JobSpec
from fedring.counters import Counters
from fedring.engine.centre import serve
from fedring.transport import topics
from fedring.transport.mqtt import MqttLink
from fedring.wire.frame import FrameLimits

log = logging.getLogger(__name__)


class StarCentre:
    """One job's centre: opened once (so no early update is dropped), run per epoch."""

    def __init__(self, link: MqttLink, job: str, key: bytes, counters: Counters) -> None:
        self.link, self.job, self.key, self.counters = link, job, key, counters
        self.endpoint = link.endpoint(topics.star(job), private=True)
        self.served = 0  # rounds served, every epoch together
        self._thread: threading.Thread | None = None
        self._channel_job = ""

    def start(
        self, spec: JobSpec, epoch: int, members: list[str], start_round: int, numel: int,
        max_frame_bytes: int = 0,
    ) -> None:  # fmt: skip
        self.stop()
        self._channel_job = f"{self.job}.e{epoch}"
        limits = FrameLimits(max_frame_bytes=max_frame_bytes) if max_frame_bytes else None
        channel = PeerChannel(self.endpoint, self._channel_job, key=self.key,
                              counters=self.counters, limits=limits)  # fmt: skip
        settings = build.centre_settings(spec, start_round)

        def body() -> None:
            try:
                served = serve(channel, tuple(members), numel, settings)
            except Exception as exc:  # the agents report the failed round: log, count
                self.counters.add("centre_stopped")
                log.warning("epoch %d: the star's centre stopped: %s", epoch, exc)
                return
            self.served += served
            log.info("epoch %d: the star's centre served %d rounds", epoch, served)

        self._thread = threading.Thread(target=body, name=f"centre-e{epoch}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Interrupt the running epoch's centre and wait for its thread."""
        if self._thread is None:
            return
        self.link.interrupt(self._channel_job)
        self._thread.join(10.0)
        self._thread = None

    def close(self) -> None:
        self.stop()
        self.endpoint.close()
