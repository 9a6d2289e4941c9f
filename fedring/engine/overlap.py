"""Overlap: a sync round's gradient all-reduced bucket by bucket while backward runs,
or a whole round late (`DelayedUpdate`) while the next round computes.

With the job field `bucket_kb`, the flat gradient is cut into buckets (see
`engine.buckets`). A hook on every parameter notes when its gradient is in;
once all of a bucket's are, the bucket goes to one communication thread, which
scales it, runs error feedback and group-top-k on its entries and all-reduces it
alone (`Reducer.allreduce_bucket`) while backward goes on with the earlier layers.
The optimizer's `step` then waits for the last bucket, puts the reduced vector together
and takes the same optimizer step as without overlap.

Why the method stays intact:

- groups never straddle a bucket, so group-top-k keeps per bucket exactly what it
  keeps over the whole vector; error feedback works entry by entry anyway;
- every agent hands its buckets over in the same order and one thread reduces
  them in that order, so the ring stays in step; frames carry the bucket in
  their phase (`collective.ring.tagged`);
- a bucket's ring chunks fall elsewhere than the whole vector's, so the agents'
  contributions are added in another order: the result differs from a run
  without buckets by float rounding, and every agent still ends with the same
  parameters.

Tuning and limits: the forward pass and the backward of bucket 0's layers come
before any communication, so an overlapped step still takes at least
``forward + backward(bucket 0) + communication`` (plus the last bucket's ring when
compute is the longer part). Overlap hides the backward of the earlier layers:
at most min(backward, communication) per round. Small first buckets start the
ring early; few buckets keep the per-bucket ring latency (2(N-1) steps each) and
frame headers low. A handful of buckets per model is the place to start.

Errors: a `CollectiveError` on the communication thread skips the buckets behind
it, ends the thread, and is raised again on the main thread, the same object.

`update_delay = 1` (`DelayedUpdate`) hides all of the communication instead: a
round's gradient is agreed on a `CommThread` during the next round's forward and
backward and applied one round late (a one-step-stale gradient, as in
delayed-update SGD).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

import torch

from fedring.collective.channel import CollectiveTimeout
from fedring.engine.buckets import Readiness, bucket_layout
from fedring.engine.reducer import Reducer
from fedring.transport.base import Deadline

Reduce = Callable[[int, torch.Tensor], torch.Tensor]
Agree = Callable[[torch.Tensor, int], torch.Tensor]  # (vec, round) -> the group's agreement


class CommThread:
    """One thread that reduces the buckets it is handed, one after another.

    The owner hands buckets over with `hand`, then calls `finish` (or `abandon`
    after a failure of its own); either way the thread ends after the bucket it is
    reducing, whose every ring step has its own deadline.
    """

    def __init__(self, reduce: Reduce, name: str, baton: Yielder | None = None) -> None:
        self._reduce = reduce
        self._baton = baton  # the simulator's turn-taking: waiting here must pass it on
        self._cond = threading.Condition()
        self._todo: deque[tuple[int, torch.Tensor]] = deque()
        self._done: dict[int, torch.Tensor] = {}
        self._handed = 0
        self._closed = False
        self._error: BaseException | None = None
        self.first_handed = 0.0  # perf_counter() of the first `hand`
        self.last_reduced = 0.0  # perf_counter() when the last bucket was reduced
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def hand(self, index: int, vec: torch.Tensor) -> None:
        with self._cond:
            if not self._handed:
                self.first_handed = time.perf_counter()
            self._todo.append((index, vec))
            self._handed += 1
            self._cond.notify_all()

    def finish(self, deadline: Deadline) -> dict[int, torch.Tensor]:
        """The reduced buckets by index once all are done; raise the thread's error."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            while len(self._done) < self._handed and self._error is None:
                if deadline.expired:
                    self._todo.clear()
                    raise CollectiveTimeout(f"{self._thread.name}: buckets still unreduced")
                self._wait(deadline.remaining())
        self._thread.join(deadline.remaining())  # it is past its last bucket
        if self._error is not None:
            raise self._error
        return self._done

    def abandon(self) -> None:
        """Drop the buckets not started; the thread ends after the current one."""
        with self._cond:
            self._closed = True
            self._todo.clear()
            self._cond.notify_all()

    def _wait(self, timeout: float) -> None:
        if self._baton is None:
            self._cond.wait(timeout)
        else:
            self._baton.wait(self._cond, timeout)

    def _run(self) -> None:
        # In the simulator the thread takes turns with the agents like they do with
        # each other (see `Baton`): no GIL convoy, and no overlap that a shared CPU
        # could not give anyway.
        with self._baton.turn() if self._baton else contextlib.nullcontext():
            while (index_vec := self._next()) is not None:
                try:
                    out = self._reduce(*index_vec)
                except BaseException as exc:  # handed to the owner, raised there
                    with self._cond:
                        self._error = exc
                        self._todo.clear()
                        self._cond.notify_all()
                    return
                with self._cond:
                    self._done[index_vec[0]] = out
                    self.last_reduced = time.perf_counter()
                    self._cond.notify_all()

    def _next(self) -> tuple[int, torch.Tensor] | None:
        """The next bucket to reduce; None once the owner closed and none is left."""
        with self._cond:
            while not self._todo and not self._closed:
                self._wait(1.0)  # `finish` or `abandon` always closes
            return self._todo.popleft() if self._todo else None


class Yielder(Protocol):
    """Turn-taking among threads (the simulator's `Baton`): waits must pass it on."""

    def turn(self) -> contextlib.AbstractContextManager[None]: ...

    def wait(self, cond: threading.Condition, timeout: float) -> bool: ...


class BucketOverlap:
    """Hooks on the parameters that hand each bucket to a `CommThread` once its
    gradients are in (see the module docstring); `collect` returns the round's sum."""

    def __init__(
        self, params: list[torch.Tensor], reducer: Reducer, bucket_kb: int,
        yielder: Yielder | None = None,
        context: Callable[[], tuple[int, float]] | None = None,
    ) -> None:  # fmt: skip
        sizes = [p.numel() for p in params]
        self.reducer, self.params, self.yielder = reducer, params, yielder
        self.buckets = bucket_layout(sizes, bucket_kb * 1024 // 4, reducer.settings.group_size)
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.round, self.scale = 0, 1.0
        # (round, scale) of the round whose backward is running: read when its
        # first gradient arrives, before `step` (the owner's current values)
        self.context = context or (lambda: (self.round, self.scale))
        self._comm: CommThread | None = None
        self._ready = Readiness(self.buckets)
        self._flat = torch.zeros(sum(sizes), dtype=torch.float32)
        self._hooks = [  # a frozen parameter takes no hook; `collect` covers its bucket
            p.register_post_accumulate_grad_hook(lambda _, i=i: self._arrived(i))
            for i, p in enumerate(params)
            if p.requires_grad
        ]

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        if self._comm is not None:
            self._comm.abandon()
            self._comm = None

    def _start(self) -> CommThread:
        if self._comm is None:
            r, scale = self.context()  # fixed for all of this round's buckets

            def reduce(j: int, vec: torch.Tensor) -> torch.Tensor:
                b = self.buckets[j]
                return self.reducer.allreduce_bucket(
                    vec, span=(b.start, b.end), scale=scale, round=r, bucket=j
                )

            name = f"{self.reducer.channel.name}-comm-r{r}"
            self._comm = CommThread(reduce, name, self.yielder)
            self._ready = Readiness(self.buckets)
        return self._comm

    def _copy_grad(self, i: int) -> None:
        grad = self.params[i].grad
        if grad is not None:
            a = self.offsets[i]
            self._flat[a : a + grad.numel()].copy_(grad.detach().reshape(-1))

    def _arrived(self, i: int) -> None:
        comm = self._start()
        self._copy_grad(i)
        for j in self._ready.arrived(i):
            comm.hand(j, self._flat[self.buckets[j].start : self.buckets[j].end])

    def collect(self) -> tuple[torch.Tensor, float]:
        """The agreed sum of this round's gradients and the seconds from the first
        bucket handed over to the last one reduced."""
        comm = self._start()
        try:
            rest = self._ready.rest()
            for i in {i for j in rest for i in self.buckets[j].params}:
                self._copy_grad(i)  # parameters that got no gradient hook this step
            for j in rest:
                comm.hand(j, self._flat[self.buckets[j].start : self.buckets[j].end])
        except BaseException:
            comm.abandon()
            raise
        finally:
            self._comm = None
        parts = comm.finish(Deadline.after(self._deadline_s()))
        total = torch.empty_like(self._flat)
        for j, b in enumerate(self.buckets):
            total[b.start : b.end] = parts[j]
        return total, comm.last_reduced - comm.first_handed

    @property
    def grad_norm(self) -> float:
        """Norm of this member's own gradient of the last round."""
        return float(self._flat.norm())

    def _deadline_s(self) -> float:
        """A bound the communication thread's own deadlines keep it under: every
        ring step of every bucket waits at most its step timeout."""
        c = self.reducer.collective
        return 2 * c.world * len(self.buckets) * c.timeout_s + 1.0


class DelayedUpdate:
    """`update_delay`: the gradient waiting to be agreed, and its agreement in flight.

    `launch` starts agreeing the pending gradient (from `zero_grad`, so it travels
    during the forward pass); `total` waits for it and keeps this round's gradient
    for the next round.
    """

    def __init__(self, agree: Agree, reducer: Reducer, yielder: Yielder | None = None) -> None:
        self.agree, self.reducer, self.yielder = agree, reducer, yielder
        self.pending: torch.Tensor | None = None
        self.comm: CommThread | None = None

    def launch(self, round: int) -> None:
        """Agree the pending gradient as `round`'s, unless none waits or it is on its way."""
        if self.pending is None or self.comm is not None:
            return

        def reduce(_j: int, vec: torch.Tensor) -> torch.Tensor:
            return self.agree(vec, round)

        name = f"{self.reducer.channel.name}-delayed-r{round}"
        self.comm = CommThread(reduce, name, self.yielder)
        self.comm.hand(0, self.pending)

    def total(self, round: int, grad: torch.Tensor) -> tuple[torch.Tensor | None, float | None]:
        """The agreed sum of the pending gradient (None in a segment's first round) and
        the seconds its agreement took; `grad` then waits for the next round."""
        self.launch(round)
        total, comm_s = None, None
        if self.comm is not None:
            comm, self.comm = self.comm, None
            c = self.reducer.collective
            total = comm.finish(Deadline.after(2 * c.world * c.timeout_s + 1.0))[0]
            comm_s = comm.last_reduced - comm.first_handed
        self.pending = grad
        return total, comm_s

    def drop(self) -> None:
        """Forget the pending gradient and stop its agreement."""
        if self.comm is not None:
            self.comm.abandon()
        self.pending, self.comm = None, None
