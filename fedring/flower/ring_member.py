"""One node of the relayed ring: the engine's reducer and distributed optimizer, rebuilt
from `Context.state` for every message.

A node may run each message in a fresh process, so it cannot keep a
`DistributedOptimizer` alive across a round's relayed steps. `RingMember` rebuilds
what `fedring simulate` and an MQTT agent train with (`build.optimizer`: the task's
own `torch.optim` optimizer or the job's SGD; `build.reducer_settings`;
`build.scaling`), loads the node's saved state into it (held model, sampler, error
feedback, the optimizer's state) and drives it in two halves around the relay:

- `update` (ring step 0): this round's update (one gradient in ``sync``, the
  parameter delta after `local_steps` steps of the inner optimizer in ``local``),
  times the node's weight, compressed by the engine's `Reducer`: error feedback, the
  DGC density warm-up and momentum correction, as in-process;
- `apply` (the last step): what the bounded ring dropped goes back into error
  feedback, and `DistributedOptimizer.apply_agreed` applies the agreed sum with the
  inner optimizer and its restored state, as `step` applies an all-reduced gradient.

Same code on the same inputs, so the relayed ring ends every round on the model the
in-process library holds, bit for bit (`tests/flower/test_ring_member.py`, AdamW
included). Not carried: model buffers (BatchNorm statistics are neither kept between
messages nor averaged), bucket overlap and the delayed update (in-process only).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from fedring import build
from fedring.collective.channel import PeerChannel
from fedring.collective.ring import Ring
from fedring.compression.payload import Payload
from fedring.config import JobSpec
from fedring.engine.optimizer import DistributedOptimizer
from fedring.engine.reducer import Reducer
from fedring.flower import carrier
from fedring.flower.node import NodeState, restore
from fedring.flower.optimizer_state import OptimizerState


class RingMember:
    """One node's member of the relayed ring `members` (names in ring order) in one message."""

    def __init__(self, spec: JobSpec, state: NodeState, members: list[str], me: str,
                 weight: float) -> None:  # fmt: skip
        self.spec, self.state, self.weight = spec, state, weight
        self.work = restore(spec, state)
        state.optimizer.load_into(self.work.optimizer)
        self.scaling = build.scaling(spec, self.work.optimizer)
        left = members[(members.index(me) - 1) % len(members)]
        # The ring object only names the group (world, members): the relay moves the frames.
        ring = Ring(PeerChannel(carrier.Mailbox(me, left), carrier.JOB), tuple(members),
                    timeout_s=0.0)  # fmt: skip
        self.reducer = Reducer(ring, state.params.numel(), build.reducer_settings(spec))
        ef = self.reducer.ef
        if ef is not None:
            ef.residual.copy_(state.residual)
            if ef.velocity is not None and state.ef_velocity is not None:
                ef.velocity.copy_(state.ef_velocity)

    def update(self, round: int) -> tuple[Payload, float]:
        """This round's compressed, weighted update and its training loss."""
        self.scaling.apply(round)
        work = self.work
        if self.spec.sync == "sync":
            loss, vec = work.gradient()
        else:
            anchor = work.params
            work.optimizer.state.clear()  # each round's local steps start afresh (in-process too)
            losses = []
            for _ in range(self.spec.local_steps):
                losses.append(work.gradient()[0])
                work.optimizer.step()
            loss, vec = sum(losses) / len(losses), work.params - anchor
            work.set_params(anchor)  # the held model moves only by what the ring agrees
        payload = self.reducer.compress(vec * self.weight, round)
        return payload, loss

    def apply(self, round: int, total: torch.Tensor, kept: torch.Tensor) -> None:
        """Apply the ring's sum as every member does with the same bits."""
        self.scaling.apply(round)
        if self.reducer.ef is not None:
            self.reducer.ef.keep(kept)
        # The relay checked the start (enrolment) and did the exchange: trust, no overlap.
        settings = replace(build.sync_settings(self.spec), bucket_kb=0, update_delay=0)
        opt = DistributedOptimizer(self.work.optimizer, self.reducer, settings, model=None,
                                   weight=self.weight, initial="trust")  # fmt: skip
        opt.round = round
        try:
            opt.apply_agreed(total)
        finally:
            opt.close()

    def saved(self) -> NodeState:
        """The node's state after this message, to keep in `Context.state`."""
        sampler = self.work.sampler.state_dict()
        ef = self.reducer.ef
        return replace(
            self.state,
            params=self.work.params,
            residual=ef.residual.clone() if ef is not None else self.state.residual,
            ef_velocity=ef.velocity.clone() if ef is not None and ef.velocity is not None
            else None,
            optimizer=OptimizerState.of(self.work.optimizer),
            rng=sampler["rng"], order=sampler["order"], pos=sampler["pos"],
            samples_seen=sampler["samples_seen"],
        )  # fmt: skip
