"""The coordinator as the centre: star jobs (``topology = "star"``, median, trimmed)
and asynchronous ones (``sync = "async"``).

Agents send their compressed update for each round to the coordinator, which
combines them by the job's rule (`engine.centre`, the code `fedring simulate`
runs) and sends every agent the same result. Those frames travel on a private
endpoint of the job's star topic (`topics.star`), apart from the coordinator's
control messages; each epoch runs the centre on a thread of its own, over a
channel named like the agents' (``JOB.eN``) and signed with the job's key.

An asynchronous job's centre holds the model (`engine.centre.serve_async`): each
delta is applied with its staleness weight as it comes and answered with a patch
against the model that agent last received where smaller (`engine.async_reply`;
``async_reply_patch`` / ``async_reply_dense`` count them), a slow or lost agent
holds nobody up, and every new version is queued in `versions` for the
coordinator's loop (metrics row; the parameters where a checkpoint is due). The
centre evaluates the model every `eval_every` versions and ends the job at the
target accuracy.

The centre stops when the epoch does: a re-formation or the end of the job
interrupts it, and the next epoch starts another from the checkpoint's round.
A centre stopped by the agents (one lost or silent) is theirs to report; one
stopped by anything else keeps the error in `failure`, and `check` raises it,
so the coordinator ends the job with it (its agents then see it leave) instead
of waiting for the agents' timeout and re-forming around the same fault.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from fedring import build
from fedring.collective.channel import CollectiveError, PeerChannel
from fedring.config import JobSpec
from fedring.counters import Counters
from fedring.engine.centre import AsyncState, serve, serve_async
from fedring.engine.plan import Plan
from fedring.training.models import set_flat_params
from fedring.transport import topics
from fedring.transport.mqtt import MqttLink
from fedring.wire.frame import FrameLimits

log = logging.getLogger(__name__)

Evaluate = Callable[[torch.Tensor], tuple[float, float]]  # flat params -> (test loss, accuracy)


class StarCentre:
    """One job's centre: opened once (so no early update is dropped), run per epoch."""

    def __init__(self, link: MqttLink, job: str, key: bytes, counters: Counters) -> None:
        self.link, self.job, self.key, self.counters = link, job, key, counters
        self.endpoint = link.endpoint(topics.star(job), private=True)
        self.served = 0  # rounds served, every epoch together
        self.state: AsyncState | None = None  # an asynchronous job's model and staleness
        # (metrics row, parameters or None) per new version of an asynchronous job
        self.versions: queue.Queue[tuple[dict[str, Any], torch.Tensor | None]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._channel_job = ""
        # What stopped the centre other than the agents (a bug, a bad rule): the
        # coordinator raises it (`check`) rather than re-form around it for ever.
        self.failure: Exception | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(
        self, spec: JobSpec, epoch: int, members: list[str], start_round: int,
        params: torch.Tensor, max_frame_bytes: int = 0, evaluate: Evaluate | None = None,
    ) -> None:  # fmt: skip
        """Serve the epoch from `start_round`; `params` is the model there (async)."""
        self.stop()
        self._channel_job = f"{self.job}.e{epoch}"
        limits = FrameLimits(max_frame_bytes=max_frame_bytes) if max_frame_bytes else None
        # The centre takes a round's updates member by member, whatever order they come
        # in: its stash must hold all the others' (the default 256 evicts some, and the
        # round waits for an evicted update until it times out, beyond 256 members).
        channel = PeerChannel(self.endpoint, self._channel_job, key=self.key,
                              counters=self.counters, limits=limits,
                              max_stash=max(256, 4 * len(members)))  # fmt: skip
        if spec.sync == "async":
            work = self._async_body(spec, channel, members, start_round, params, evaluate)
        else:
            work = self._sync_body(spec, channel, members, start_round, params.numel())

        def body() -> None:
            try:
                work()
            except CollectiveError as exc:  # the agents report the failed round: log, count
                self.counters.add("centre_stopped")
                log.warning("epoch %d: the centre stopped: %s", epoch, exc)
            except Exception as exc:  # nobody else knows of it: `check` hands it on
                self.counters.add("centre_failed")
                log.error("epoch %d: the centre failed: %r", epoch, exc)
                self.failure = exc

        self._thread = threading.Thread(target=body, name=f"centre-e{epoch}", daemon=True)
        self._thread.start()

    def _sync_body(
        self, spec: JobSpec, channel: PeerChannel, members: list[str], start: int, numel: int
    ) -> Callable[[], None]:
        def work() -> None:
            served = serve(channel, tuple(members), numel, build.centre_settings(spec, start))
            self.served += served
            log.info("the star's centre served %d rounds", served)

        return work

    def _async_body(
        self, spec: JobSpec, channel: PeerChannel, members: list[str], start: int,
        params: torch.Tensor, evaluate: Evaluate | None,
    ) -> Callable[[], None]:  # fmt: skip
        old = self.state
        self.state = AsyncState(params.clone(), version=start,
                                staleness=dict(old.staleness) if old else {})  # fmt: skip
        t0 = time.perf_counter()

        def on_version(state: AsyncState, member: str) -> None:
            v = state.version
            row: dict[str, Any] = {"round": v, "from": member,
                                   "wall_s": round(time.perf_counter() - t0, 4)}  # fmt: skip
            if evaluate is not None and (v % spec.eval_every == 0 or v == spec.rounds):
                row["test_loss"], row["accuracy"] = evaluate(state.model)
                if spec.target_accuracy and row["accuracy"] >= spec.target_accuracy:
                    state.stop = True
            final = state.stop or v >= spec.rounds
            due = final or v % spec.checkpoint_every == 0
            self.versions.put((row, state.model.clone() if due else None))

        def work() -> None:
            assert self.state is not None
            settings = build.async_settings(spec, start)
            serve_async(channel, tuple(members), self.state, settings, on_version)
            self.served = self.state.version
            log.info("the asynchronous centre reached version %d (lost: %s)",
                     self.state.version, self.state.lost or "none")  # fmt: skip

        return work

    def check(self) -> None:
        """Raise, as itself, what stopped the centre if it was not the agents."""
        if self.failure is not None:
            raise self.failure

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


def evaluator(p: Plan, seed: int) -> Evaluate:
    """(test loss, accuracy) of flat parameters: an asynchronous job's centre holds the
    model, so the coordinator evaluates it, on the plan's test set."""
    model = p.task.model(p.dataset, seed)

    def evaluate(params: torch.Tensor) -> tuple[float, float]:
        set_flat_params(model, params)
        return p.task.evaluate(model, p.dataset)

    return evaluate
