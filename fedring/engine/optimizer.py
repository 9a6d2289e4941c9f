"""A distributed optimizer: any `torch.optim` optimizer, with its updates agreed by a group.

    opt = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), reducer,
                               model=model)   # every member now holds rank 0's start
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100)   # takes it directly
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()          # AdamW steps, the group agrees on its update
        sched.step()

`SyncSettings` (`engine.sync_settings`) says when and how the group agrees: the
modes (``sync`` every step, ``local`` every H steps), the aggregation rules, and
what a sync step agrees on: over a compressed ring, the gradient for plain SGD
(EF-SGD) and the update of the wrapped optimizer's own step for momentum SGD, Adam
and AdamW, which then keep up with dense at 1% (measured there).

Flattening order: the parameters of ``optimizer.param_groups``, group by group, in
the order each group lists them (for ``SGD(model.parameters())`` that is
`model.parameters()` order); parameters without a gradient this step count as
zeros, and frozen ones (``requires_grad=False``) are never given a gradient.
Every buffer of `model` starts as rank 0's (`engine.initial`); the running
statistics (``running_mean``, ``running_var``: BatchNorm's) are averaged over the
group at every sync point; other buffers, integer ones (``num_batches_tracked``,
a counter equal on members that took the same steps) included, stay local.

`state_dict` holds the wrapped optimizer's state, the reducer's residual, the
agreed model (`anchor`, local mode and the ``update`` agreement), where this
member's steps began and the round: plain tensors and numbers, so it round-trips
through ``torch.save`` and ``torch.load(weights_only=True)``.

Elsewhere, one concern a module: `reducer` (the collective), `sync_settings`,
`overlap` (buckets, the delayed update), `initial` (the common start), `steps` (the
guards: `DirectStepError`, `StepMismatch`), `running_stats`, `wrapped` (what a
scheduler sees).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fedring.aggregation.rules import hybrid
from fedring.collective.channel import CollectiveTimeout
from fedring.engine.initial import INITIAL_POLICIES, InitialPolicy, start_together
from fedring.engine.overlap import BucketOverlap, DelayedUpdate, Yielder
from fedring.engine.participation import SitOut, per_round, sampled
from fedring.engine.reducer import Reducer
from fedring.engine.running_stats import BUFFERS_BUCKET, RUNNING_STATS, average, running_stats
from fedring.engine.steps import InnerStepGuard, diagnosed
from fedring.engine.sync_settings import SyncSettings
from fedring.engine.wrapped import WrappedOptimizer, copied
from fedring.training.models import flat_grads, flat_params, set_flat_params

_UNSET: Any = object()  # `model=` not passed at all (None is a choice: no buffers)

# BUFFERS_BUCKET and RUNNING_STATS stay importable from here, where they were defined
__all__ = ["BUFFERS_BUCKET", "RUNNING_STATS", "DistributedOptimizer", "StepTimes", "SyncSettings"]


@dataclass
class StepTimes:
    """Seconds of the last sync step: communication (first bucket handed over to
    last one reduced with overlap) and the optimizer step around it."""

    comm_s: float = 0.0
    step_s: float = 0.0


class DistributedOptimizer(WrappedOptimizer):
    """Wraps a `torch.optim.Optimizer`; a `Reducer` agrees on its updates.

    It is a `torch.optim.Optimizer` itself, so `torch.optim.lr_scheduler` takes it
    directly (``StepLR(opt, ...)``, ``OneCycleLR(opt, ...)``): `param_groups`,
    `defaults` and `state` are the wrapped optimizer's, and a scheduler's changes of
    ``lr`` reach it. Step the scheduler after `step`, as with any optimizer.

    Parameters
    ----------
    optimizer : torch.optim.Optimizer
        The optimizer that steps once the group agreed; never call its own
        ``step()`` (it raises `DirectStepError`: one member stepping alone leaves the
        group waiting).
    reducer : Reducer
        This member's reducer over the group's collective.
    settings : SyncSettings, optional
        When and how the group agrees (every step by default).
    model : nn.Module or None
        Required. Its buffers are sent from rank 0 with the parameters at the start,
        and its running statistics (buffers named ``running_mean`` and
        ``running_var``, as torch's BatchNorm and InstanceNorm name them) are
        averaged at every sync point; other buffers stay each member's own. Pass
        ``model=None`` only for a model without buffers.
    weight : float, optional
        This member's share of the mean; 1 / world by default.
    initial : {"broadcast", "verify", "trust"}
        How members start alike (`engine.initial`): ``"broadcast"`` (default, as
        DDP) copies rank 0's parameters and buffers into every member while it is
        built; ``"verify"`` only compares sha256 digests and raises
        `InitialModelMismatch` on a member that differs; ``"trust"`` exchanges
        nothing (the caller checked the start, as `engine.plan.prepare` does).
        Rank 0 sends and goes on; every other member waits up to the group's
        `timeout_s` for it, so build the members on threads or rank 0 first.

    Notes
    -----
    Parameters with ``requires_grad=False`` keep their place in the flat vector
    (as zeros) but are never given a ``.grad``, so the wrapped optimizer (AdamW's
    weight decay included) leaves them untouched. To clip, clip this member's own
    gradient after ``backward()`` and before `step` (``clip_grad_norm_``): the
    group then agrees on clipped gradients (the agreed gradient is written into
    ``.grad`` inside `step`, too late for clipping there).
    Exchanges are tagged with `round`; a member whose peers are on other rounds
    raises `StepMismatch` naming them when its wait runs out.
    Under the ``update`` agreement (`agreement`; `ahead`: gradients at the view) a
    forward pre-hook on `model` moves this member's parameters to its `view` at the
    first forward with gradients after a step; after `step`, and in a forward under
    ``torch.no_grad()`` before the next one, it holds the agreed model like every
    member. Without `model` there is no hook, and ``auto`` keeps the gradient.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        reducer: Reducer,
        settings: SyncSettings | None = None,
        *,
        model: nn.Module | None = _UNSET,
        weight: float | None = None,
        yielder: Yielder | None = None,
        initial: InitialPolicy = "broadcast",
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, not {type(optimizer)}")
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("optimizer is already a DistributedOptimizer: wrap the inner one")
        if model is _UNSET:
            raise TypeError(
                "DistributedOptimizer needs model=: pass model=your_model (its buffers start "
                "from rank 0's and its BatchNorm statistics are averaged over the group), "
                "or model=None for a model without buffers"
            )
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module or None, not {type(model).__name__}")
        if initial not in INITIAL_POLICIES:
            raise ValueError(f"initial={initial!r} must be one of {', '.join(INITIAL_POLICIES)}")
        self.optimizer = optimizer
        self.reducer = reducer
        self.settings = settings or SyncSettings()
        self.rule = self.settings.rule
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        numel = sum(p.numel() for p in self.params)
        if numel != reducer.numel:
            raise ValueError(f"optimizer holds {numel} parameters, the reducer {reducer.numel}")
        self.weight = 1.0 / reducer.world if weight is None else weight
        self.buffers = running_stats(model)
        self.yielder = yielder
        self.round = 0  # agreements so far: steps in sync mode, syncs in local mode
        self.local_step = 0  # local mode: steps since the last sync
        self.local_steps = self.settings.local_steps  # H; the adaptive mode changes it
        self.times = StepTimes()
        self.grad_norm = 0.0  # of the last local gradient, before any agreement
        self.delayed = DelayedUpdate(self.agree, reducer, yielder)
        self.last_trained = -1  # client sampling: the last round this member took part in
        s = self.settings
        s.check()
        c = reducer.collective
        every_buffer = list(model.buffers()) if model is not None else []
        start_together(reducer.channel, c.members, self.params + every_buffer, initial,
                       c.timeout_s)  # fmt: skip
        self.anchor = flat_params(self.params)  # the agreed model (local mode, update)
        ef = reducer.ef
        compressed = reducer.topk is not None and ef is not None and ef.velocity is None
        viewable = model is not None  # the view waits for the forward (`_to_view`)
        self.agreement = s.agreement(optimizer, compressed, viewable=viewable)
        self.ahead = s.ahead(optimizer, compressed, viewable=viewable) and ef is not None
        # where this member's steps since the last sync began; None: the agreed model
        self.start: torch.Tensor | None = None
        self._view_hook = (
            model.register_forward_pre_hook(self._to_view)
            if self.ahead and model is not None
            else None
        )
        self.overlap = (
            BucketOverlap(self.params, reducer, s.bucket_kb, yielder,
                          context=lambda: (self.round, self.weight))
            if s.bucket_kb and s.mode == "sync"
            else None
        )
        self._guard = InnerStepGuard(optimizer)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise TypeError(
            "DistributedOptimizer's flat layout is fixed when it is built: add the group "
            "to the wrapped optimizer before wrapping it (and size the reducer for it)"
        )

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r}, mode={self.settings.mode!r})"

    def zero_grad(self, set_to_none: bool = False) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        if self.settings.update_delay:
            self.delayed.launch(self.round)  # last round's gradient travels during this forward

    # -- agreeing ---------------------------------------------------------------

    def takes_part(self, round: int | None = None) -> bool:
        """Client sampling: whether this member trains in `round` (always without it)."""
        s, r = self.settings, self.round if round is None else round
        if s.sample == 1.0:
            return True
        return self.reducer.collective.rank in sampled(s.seed, r, self.reducer.world, s.sample)

    def sit_out(self) -> None:
        """A round this member is not sampled for: no training, only the centre's
        result, applied as every trained member applies it."""
        with self._diagnosing():
            agreed = self.reducer.star_result(round=self.round)
        if self.agrees_updates:
            self._move_to(self.anchor + agreed, reset=False)
        else:
            self._write_grads(agreed)
            self._inner_step()
        self.round += 1
        self._sync_buffers()

    def apply_agreed(self, agreed: torch.Tensor) -> None:
        """Apply a vector the group agreed on outside this optimizer (Flower's relayed
        ring reduces over messages, not through `reducer`) as `step` and `synchronize`
        apply their own: sync mode writes it into ``.grad`` and steps the wrapped
        optimizer with its state; local mode moves the synced model by it. Buffers
        are not averaged: that collective carried none."""
        if self.agrees_updates:
            self._move_to(self.anchor + agreed)
        else:
            self._write_grads(agreed)
            self._inner_step()
        self.round += 1

    def agree(self, vec: torch.Tensor, round: int | None = None) -> torch.Tensor:
        """This member's `vec` combined with the group's by the aggregation rule."""
        r = self.round if round is None else round
        kind = self.rule.kind
        if kind == "vote":
            return self.reducer.vote(vec, round=r)
        s = self.settings
        if s.sample != 1.0:  # back after rounds out: the job's policy for the old residual
            if self.reducer.ef is not None:
                SitOut.parse(s.sit_out).apply(self.reducer.ef.residual, r - self.last_trained - 1)
            self.last_trained = r
        if self.rule.needs_star:
            return self.reducer.star(vec, round=r)
        if s.star:
            sampling = s.sample != 1.0  # the sample's mean
            scale = 1.0 / per_round(self.reducer.world, s.sample) if sampling else self.weight
            agreed = self.reducer.star(vec, round=r, scale=scale)
        else:
            agreed = self.reducer.allreduce(vec, scale=self.weight, round=r)
        if kind == "hybrid":
            agreed = hybrid(agreed, vec, self.rule.lam(r, self.settings.rounds))
        return agreed

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Sync mode: agree on the gradient and step. Local mode: step locally, and
        agree on the parameter deltas every `local_steps` steps.

        Every member must call it the same number of times: a member whose peers
        are on another step raises `StepMismatch` (a `CollectiveTimeout`) naming
        them, after the group's `timeout_s`.
        """
        if closure is not None:
            raise ValueError("DistributedOptimizer.step takes no closure: call backward first")
        if self.agrees_updates:
            self._local_step()
            return
        start = time.perf_counter()
        with self._diagnosing():
            if self.settings.update_delay:
                total = self._delayed_total()
            elif self.overlap is not None:
                total, self.times.comm_s = self.overlap.collect()
                self.grad_norm = self.overlap.grad_norm
            else:
                grad = flat_grads(self.params)
                self.grad_norm = float(grad.norm())
                total = self.agree(grad)
                self.times.comm_s = time.perf_counter() - start
        if total is not None:
            self._write_grads(total)
            self._inner_step()
        self.round += 1
        self._sync_buffers()
        self.times.step_s = time.perf_counter() - start

    def _local_step(self) -> None:
        mu = self.settings.correction
        grad = flat_grads(self.params)
        if mu:
            grad.add_(flat_params(self.params) - self.anchor, alpha=mu)
            self._write_grads(grad)
        self.grad_norm = float(grad.norm())
        self._inner_step()
        self.local_step += 1
        if self.local_step >= (self.local_steps if self.settings.mode == "local" else 1):
            self.synchronize()

    @property
    def agrees_updates(self) -> bool:
        """Local mode, or sync mode's ``update`` agreement (local mode with H = 1)."""
        return self.settings.mode == "local" or self.agreement == "update"

    def synchronize(self) -> None:
        """Agree on the parameter deltas since the last sync (local mode, or every
        step under the ``update`` agreement), move the agreed model by the agreed
        delta, and start the next steps from it."""
        start = time.perf_counter()
        delta = flat_params(self.params) - (self.anchor if self.start is None else self.start)
        with self._diagnosing():
            agreed = self.agree(delta)
        self._move_to(self.anchor + agreed)
        self.round += 1
        self._sync_buffers()
        self.times.comm_s = self.times.step_s = time.perf_counter() - start

    def _move_to(self, agreed_model: torch.Tensor, *, reset: bool = True) -> None:
        """Every member now holds `agreed_model`, and starts its next steps from it
        (local mode: with a fresh optimizer state if `reset_state_at_sync`)."""
        self.anchor = agreed_model
        set_flat_params(self.params, self.anchor)
        self.start = None
        if reset and self.settings.reset_state_at_sync and self.settings.mode == "local":
            self.optimizer.state.clear()
        self.local_step = 0

    def view(self) -> torch.Tensor:
        """This member's view: the agreed model plus its own update still waiting in
        error feedback, at full scale (the residual holds ``weight * delta``).

        With iid shards every member's waiting update is about the group's, so the
        view is about where the agreed model goes once error feedback has sent it
        all (the "virtual iterate" of EF analyses). Momentum and Adam then see
        gradients of where the model is going, not of where it stood while their
        update waited its turn in a 1% top-k, which made momentum overshoot."""
        ef = self.reducer.ef
        if not self.ahead or ef is None or not self.weight > 0:
            return self.anchor.clone()
        return self.anchor + ef.residual / self.weight

    def _to_view(self, module: nn.Module, args: Any) -> None:
        """Forward pre-hook (`ahead`): the first forward with gradients after a sync
        moves this member's parameters to its view; a forward without gradients
        (evaluation) sees the agreed model, which every member holds alike."""
        if self.start is None and torch.is_grad_enabled():
            self.start = self.view()
            set_flat_params(self.params, self.start)

    # -- guards -------------------------------------------------------------------

    def _inner_step(self) -> None:
        with self._guard.allowed():
            self.optimizer.step()

    def _write_grads(self, flat: torch.Tensor) -> None:
        """`flat` (the layout of `flat_grads`) into the ``.grad`` of every parameter
        that requires one; a frozen parameter is given none, so no optimizer moves it."""
        if flat.numel() != self.reducer.numel:
            raise ValueError(f"{flat.numel()} gradient entries for {self.reducer.numel}")
        pos = 0
        for p in self.params:
            n = p.numel()
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.empty_like(p)
                p.grad.copy_(flat[pos : pos + n].reshape(p.shape))
            pos += n

    @contextmanager
    def _diagnosing(self) -> Iterator[None]:
        """A timed-out wait becomes `StepMismatch` if peers are on other rounds."""
        try:
            yield
        except CollectiveTimeout as exc:
            raise diagnosed(exc, self.reducer.channel, self.round) from exc

    # -- update_delay -------------------------------------------------------------

    def _delayed_total(self) -> torch.Tensor | None:
        """The agreed sum of last round's gradient (None in a segment's first round);
        this round's gradient waits for the next."""
        grad = flat_grads(self.params)
        total, comm_s = self.delayed.total(self.round, grad)
        if comm_s is not None:
            self.times.comm_s = comm_s
        self.grad_norm = float(grad.norm())
        return total

    def drop_pending(self) -> None:
        """Forget a delayed gradient (e.g. one of parameters that diverged)."""
        self.delayed.drop()

    # -- buffers and state --------------------------------------------------------

    def _sync_buffers(self) -> None:
        """Average the running statistics over the group (`engine.running_stats`)."""
        with self._diagnosing():
            average(self.buffers, self.reducer, self.round)

    def state_dict(self) -> dict[str, Any]:
        """Everything this member needs to continue bit for bit; plain tensors only."""
        pending = self.delayed.pending
        return {
            "optimizer": copied(self.optimizer.state_dict()),
            "reducer": self.reducer.state_dict(),
            "anchor": self.anchor.clone(),
            "start": None if self.start is None else self.start.clone(),
            "round": self.round,
            "local_step": self.local_step,
            "pending": None if pending is None else pending.clone(),
        }

    def reset_anchor(self) -> None:
        """Take the current parameters as the synced model (after loading new ones)."""
        self.anchor = flat_params(self.params)
        self.start = None
        self.local_step = 0

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.optimizer.load_state_dict(copied(state["optimizer"]))
        self.reducer.load_state_dict(state["reducer"])
        self.anchor = state["anchor"].clone()
        start = state.get("start")
        self.start = None if start is None else start.clone()
        self.round = int(state["round"])
        self.local_step = int(state["local_step"])
        self.drop_pending()
        pending = state.get("pending")
        self.delayed.pending = None if pending is None else pending.clone()

    def close(self) -> None:
        """Remove the backward hooks and the guard on the wrapped optimizer's step,
        and stop any communication thread."""
        if self.overlap is not None:
            self.overlap.close()
        if self._view_hook is not None:
            self._view_hook.remove()
        self._guard.remove()
        self.drop_pending()

