"""The round loop: the one loop that `fedring simulate`, the agent daemon and a user's
own script run, over a `Member` (model, distributed optimizer, batches, loss).

A round is one agreement of the group: one step in ``sync`` mode, H local steps
and their delta in ``local`` mode. ``adaptive`` is local mode with the interval
set from the loss trend as in AdaComm (Wang & Joshi 2019):
H_k = ceil(H_0 * sqrt(L_k / L_0)), long while the loss is high, short near
convergence (SEEDS D).

Every `eval_every` rounds each member evaluates on the same held-out set. With
identical parameters that gives identical numbers everywhere, so the decisions
taken from them (roll back on divergence, stop at the target, adapt H) are the
same on every member without any extra message. The divergence monitor is a
hook: a loss that is not finite or blew up restores the last good state and
halves the learning rate (SEEDS A: "retry automatically or degrade").
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fedring.engine.lr import LinearScaling
from fedring.engine.resync import ResyncSettings, resync
from fedring.engine.state import TrainerState
from fedring.engine.task import LossFn
from fedring.training.monitor import Monitor

Batch = tuple[torch.Tensor, torch.Tensor]
Evaluate = Callable[[nn.Module], tuple[float, float]]  # (held-out loss, metric)


@dataclass(frozen=True)
class LoopSettings:
    rounds: int = 600  # agreements of the group
    eval_every: int = 10  # rounds between evaluations (and divergence checks)
    target: float = 0.0  # stop once the metric reaches it (0 = run all rounds)
    adaptive: bool = False  # local mode: adapt H from the loss trend (AdaComm)
    stop_at_target: bool = True  # off where members may disagree (hybrid)
    # Mixed architectures: take the head's parameters every K rounds (`engine.resync`);
    # the target then stops the job only at a re-sync round, where members agree.
    resync: ResyncSettings = field(default_factory=ResyncSettings)


@dataclass
class Member:
    """What one member trains: its state, its batches, its loss and its evaluation."""

    state: TrainerState
    next_batch: Callable[[], Batch]
    loss_fn: LossFn
    evaluate: Evaluate
    scaling: LinearScaling
    on_round: Callable[[int, dict[str, Any]], None] | None = None
    before_round: Callable[[int], None] | None = None  # e.g. keep a state to retry from
    start_round: int = 0  # resume here (the member already holds the state before it)


@dataclass
class LoopResult:
    rows: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    rollbacks: int = 0
    rounds_run: int = 0


def train_step(member: Member) -> tuple[float, float]:
    """Forward, backward and one `DistributedOptimizer.step` on the next batch;
    returns the loss and the seconds of forward and backward."""
    opt, model = member.state.optimizer, member.state.model
    x, y = member.next_batch()
    start = time.perf_counter()
    model.train()
    opt.zero_grad()
    loss = member.loss_fn(model(x), y)
    loss.backward()
    compute = time.perf_counter() - start
    opt.step()
    return float(loss.detach()), compute


def run(member: Member, settings: LoopSettings) -> LoopResult:
    """Train from `member.start_round` to `settings.rounds` (or the target)."""
    state, opt = member.state, member.state.optimizer
    monitor, result = Monitor(), LoopResult()
    base_interval = opt.local_steps
    first_loss, _ = member.evaluate(state.model)
    good = state.snapshot(with_sampler=False)
    opt.round = member.start_round
    for r in range(member.start_round, settings.rounds):
        if member.before_round is not None:
            member.before_round(r)
        row = _round(member, r)
        if settings.resync.due(r, settings.rounds):
            row.update(resync(opt, r).row(), resynced=True)
        result.rows.append(row)
        result.rounds_run = r + 1
        if (r + 1) % settings.eval_every == 0 or r + 1 == settings.rounds:
            test_loss, metric = member.evaluate(state.model)
            verdict = monitor.check(test_loss)
            if verdict == "rollback":
                # the parameters go back, the round count does not: a star's centre
                # (and the loop's `r`) go on from here, and so must the exchanges
                agreed_rounds = opt.round
                state.restore(good)
                opt.round = agreed_rounds
                opt.drop_pending()  # a gradient of the diverged parameters
                member.scaling.factor *= 0.5
                result.rollbacks += 1
            else:
                good = state.snapshot(with_sampler=False)
            if settings.adaptive and math.isfinite(test_loss):
                ratio = max(test_loss, 1e-12) / max(first_loss, 1e-12)
                opt.local_steps = max(1, math.ceil(base_interval * math.sqrt(min(1.0, ratio))))
            ev = {"round": r + 1, "test_loss": test_loss, "accuracy": metric, "verdict": verdict,
                  "bytes_sent": row["bytes_sent"], "samples": _samples(state)}  # fmt: skip
            result.evals.append(ev)
            row.update(ev)
            agreed = not settings.resync.every or row.get("resynced", False)
            if settings.target and metric >= settings.target and settings.stop_at_target and agreed:
                _report(member, r, row)
                break
        _report(member, r, row)
    return result


def _round(member: Member, r: int) -> dict[str, Any]:
    """One agreement: one sync step, or the local steps up to the next sync."""
    opt = member.state.optimizer
    lr = member.scaling.apply(r)
    interval = opt.local_steps
    start = time.perf_counter()
    timing: dict[str, Any]
    if not opt.takes_part(r):  # client sampling: the centre's result, no training
        opt.sit_out()
        loss, timing = math.nan, {"sat_out": True}
    elif opt.settings.mode == "sync":
        loss, compute = train_step(member)
        timing = {"compute_s": compute, "comm_s": opt.times.comm_s}
        timing["step_s"] = time.perf_counter() - start
    else:
        losses = [train_step(member)[0] for _ in range(interval)]
        loss, timing = sum(losses) / len(losses), {}
    reducer = opt.reducer
    return {
        "round": r + 1, "loss": loss, "grad_norm": opt.grad_norm, "lr": lr, "interval": interval,
        "compression_error": reducer.last_error, "residual_norm": reducer.residual_norm,
        "bytes_sent": reducer.channel.endpoint.stats.bytes_sent, **timing,
    }  # fmt: skip


def _samples(state: TrainerState) -> int:
    return state.sampler.samples_seen if state.sampler is not None else 0


def _report(member: Member, r: int, row: dict[str, Any]) -> None:
    if member.on_round is not None:
        member.on_round(r, row)
