"""One agent's part of a job: its verified shard, its model, and runs of rounds.

A job runs in *segments*: the coordinator's manifest names the members in ring
order, the epoch, and the round to start from. A lost peer, a returning one, or
a restarted coordinator ends a segment; the next one starts from the round the
coordinator has a checkpoint of. The worker keeps its full state (parameters,
velocity, error-feedback residual, batch order) at the start of the last few
rounds, so when it holds that round it continues exactly as if nothing had
happened; otherwise it loads the checkpoint's parameters, checked by sha256.

The rounds themselves are `training.sync.run_agent`, the same code as
`fedring simulate`, over a `PeerChannel` on the MQTT endpoint.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fedring.collective.channel import CollectiveError, PeerChannel
from fedring.collective.torus import build_ring
from fedring.config import JobSpec
from fedring.counters import Counters
from fedring.firmware_profiles.apply import check_budget, dataset_bytes, estimate_memory
from fedring.firmware_profiles.schema import Profile
from fedring.training.datasets import load_dataset
from fedring.training.exchange import Exchange
from fedring.training.models import build_model, flat_sha256, param_count, params_sha256
from fedring.training.sharding import ShardManifest, make_shards, shard_data, verify_shard
from fedring.training.sync import AgentContext, run_agent
from fedring.training.trainer import LocalTrainer
from fedring.transport.base import Endpoint
from fedring.wire.frame import FrameLimits

log = logging.getLogger(__name__)

KEEP_SNAPSHOTS = 4


class JobRefused(ValueError):
    """The manifest asks for something this agent cannot verify or hold."""


class Halted(CollectiveError):
    """The coordinator halted the segment at a round boundary."""


@dataclass
class Segment:
    """One manifest: who is in the ring, from which round, under which epoch."""

    job: str
    epoch: int
    members: list[str]
    start_round: int
    params_sha256: str  # expected state at start_round
    head: str  # uploads the checkpoint every `checkpoint_every` rounds
    max_frame_bytes: int = 0  # the ring's frame size (the smallest member's); 0: the default

    @property
    def channel_job(self) -> str:
        return f"{self.job}.e{self.epoch}"


@dataclass
class _State:
    params: torch.Tensor
    velocity: torch.Tensor
    residual: torch.Tensor | None
    rng: torch.Tensor
    order: torch.Tensor
    pos: int
    samples: int
    pending: torch.Tensor | None = None  # update_delay: last round's gradient, not yet reduced


class JobWorker:
    """The agent's state for one job, kept across segments."""

    def __init__(
        self, me: str, job: str, spec: JobSpec, shard: int, manifest: dict[str, Any],
        model_sha256: str, data_dir: Path | None = None, budget: Profile | None = None,
    ) -> None:  # fmt: skip
        self.me, self.job, self.spec, self.shard = me, job, spec, shard
        dataset_spec = spec.dataset
        if dataset_spec.startswith("npz:") and data_dir is not None:
            dataset_spec = f"npz:{data_dir / dataset_spec[4:]}"
        dataset = load_dataset(dataset_spec, spec.seed)
        shards_manifest = ShardManifest.from_dict(manifest)
        if shards_manifest.n_agents != spec.agents:
            raise JobRefused(f"manifest has {shards_manifest.n_agents} shards, job {spec.agents}")
        index = make_shards(dataset.y_train.numpy(), spec.agents, spec.sharding, spec.seed)[shard]
        x, y = shard_data(dataset, index)
        verify_shard(shards_manifest, shard, x, y)
        model = build_model(spec.model, dataset.feature_shape, dataset.num_classes, spec.seed)
        if params_sha256(model) != model_sha256:
            raise JobRefused(
                f"initial model sha256 {params_sha256(model)[:12]}... != manifest "
                f"{model_sha256[:12]}...: different torch or model code than the coordinator"
            )
        if budget is not None:  # refuse before training, with the estimate and the budget
            data = dataset_bytes(dataset)
            check_budget(budget, estimate_memory(spec, model, dataset.feature_shape, data))
        self.trainer = LocalTrainer(
            model, x, y, batch_size=spec.batch_size, momentum=spec.momentum, seed=spec.seed,
            rank=shard,
        )  # fmt: skip
        self.x_test, self.y_test = dataset.x_test, dataset.y_test
        self.numel = param_count(model)
        self.exchange: Exchange | None = None
        self.states: OrderedDict[int, _State] = OrderedDict()
        self.committed = 0  # rounds completed in the current state
        self.step_s = probe_step(model, x, y, self.trainer.batch_size)
        self._keep(0)

    # -- state ------------------------------------------------------------------

    def _residual(self) -> torch.Tensor | None:
        ex = self.exchange
        return ex.ef.residual if ex is not None and ex.ef is not None else None

    def _keep(self, r: int) -> None:
        t = self.trainer
        res = self._residual()
        pending = self.exchange.pending if self.exchange is not None else None
        self.states[r] = _State(
            t.params, t.velocity.clone(), None if res is None else res.clone(),
            t._gen.get_state(), t._order.clone(), t._pos, t.samples_seen,
            None if pending is None else pending.clone(),
        )  # fmt: skip
        self.states.move_to_end(r)
        # The coordinator may restart the ring from either of the two newest
        # checkpoint rounds (the newer one's upload may not be saved yet): keep both.
        every = self.spec.checkpoint_every
        keep = sorted(k for k in self.states if k % every == 0)[-2:]
        while len(self.states) > KEEP_SNAPSHOTS:
            oldest = next(k for k in self.states if k not in keep)
            del self.states[oldest]

    def state_sha256(self, r: int) -> str | None:
        st = self.states.get(r)
        return None if st is None else flat_sha256(st.params)

    def restore(self, r: int) -> bool:
        """Return to the state at the start of round `r`, if still held."""
        st = self.states.get(r)
        if st is None:
            return False
        t = self.trainer
        t.set_params(st.params)
        t.velocity.copy_(st.velocity)
        res = self._residual()
        if res is not None:
            if st.residual is not None:
                res.copy_(st.residual)
            else:
                res.zero_()
        t._gen.set_state(st.rng)
        t._order, t._pos, t.samples_seen = st.order.clone(), st.pos, st.samples
        if self.exchange is not None:
            self.exchange.pending = None if st.pending is None else st.pending.clone()
        self.committed = r
        return True

    def load(self, r: int, params: torch.Tensor) -> None:
        """Take the checkpoint's parameters for round `r` (velocity kept at zero)."""
        self.trainer.set_params(params)
        self.trainer.velocity.zero_()
        if self.exchange is not None:
            self.exchange.pending = None  # the checkpoint holds parameters only
        self.states.clear()
        self.committed = r
        self._keep(r)

    # -- running ----------------------------------------------------------------

    def run(
        self,
        seg: Segment,
        endpoint: Endpoint,
        key: bytes,
        counters: Counters,
        halt: threading.Event,
        on_round: Callable[[int, dict[str, Any]], None],
        gate: Callable[[int], None] | None = None,
    ) -> dict[str, Any]:
        """Run rounds from `seg.start_round` to the end; raise `CollectiveError` if cut."""
        spec = self.spec.replace(agents=len(seg.members))
        limits = FrameLimits(max_frame_bytes=seg.max_frame_bytes) if seg.max_frame_bytes else None
        channel = PeerChannel(endpoint, seg.channel_job, key=key, counters=counters,
                              limits=limits)  # fmt: skip
        ring = build_ring(channel, tuple(seg.members), spec.topology, spec.timeout_s)
        if self.exchange is None:
            self.exchange = Exchange.build(ring, spec, self.numel)
            if self.committed == 0 and self.exchange.ef is not None:
                self._keep(0)  # the round-0 state now includes the (zero) residual
        else:
            self.exchange.ring, self.exchange.spec = ring, spec

        def before(r: int) -> None:
            if gate is not None:
                gate(r)
            if halt.is_set():
                raise Halted(f"{self.me}: halted before round {r}")
            self._keep(r)

        def after(r: int, row: dict[str, Any]) -> None:
            self.committed = r + 1
            on_round(r, row)

        ctx = AgentContext(
            spec, self.trainer, self.exchange, self.x_test, self.y_test,
            1.0 / len(seg.members), after, before, seg.start_round,
        )  # fmt: skip
        result = run_agent(ctx)
        last = result.evals[-1] if result.evals else {}
        return {
            "rounds": self.committed,
            "accuracy": last.get("accuracy", 0.0),
            "test_loss": last.get("test_loss", 0.0),
            "sha256": params_sha256(self.trainer.model),
            "rollbacks": result.rollbacks,
        }


def probe_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int,
               steps: int = 3) -> float:  # fmt: skip
    """Seconds per training step (forward, backward) of this job's model on this
    board, measured on a copy so the job's state and random streams stay untouched."""
    twin = copy.deepcopy(model)
    xb, yb = x[:batch], y[:batch]
    best = float("inf")
    for _ in range(steps + 1):  # the first step warms up the allocator
        start = time.perf_counter()
        twin.zero_grad()
        torch.nn.functional.cross_entropy(twin(xb), yb).backward()
        best = min(best, time.perf_counter() - start)
    return best
