"""One node's side of a Flower job, without Flower: enrol, then one round per message.

A Flower node may run every message in a fresh process (the deployment engine
does), so everything a node must remember between rounds lives in a `NodeState`
of plain tensors and ints that the ClientApp keeps in `Context.state`: the
global model it holds, its error-feedback residual (so what compression left out
in round r is sent in round r+1), its batch sampler's position and RNG state, and
(the relayed ring) its optimizer's state.

A round: apply the ServerApp's downlink to the held model and check its sha256,
compute the update (`sync`: one gradient; `local`: the parameter delta after
`local_steps` momentum-SGD steps), and compress it with error feedback. The relayed
ring's rounds go through the engine's reducer and distributed optimizer instead
(`fedring.flower.ring_member`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import torch
from torch import nn

from fedring import build
from fedring.aggregation.rules import Aggregation, capped_weights
from fedring.compression.error_feedback import ErrorFeedback
from fedring.compression.group_topk import GroupTopK, k_for
from fedring.compression.payload import Payload
from fedring.compression.quantize import SignQuantizer
from fedring.compression.schedule import DensitySchedule
from fedring.config import JobSpec
from fedring.engine.local import LocalWork
from fedring.engine.participation import SitOut
from fedring.engine.plan import Plan, prepare
from fedring.engine.reducer import compress_update
from fedring.engine.sampler import ShardSampler
from fedring.flower.optimizer_state import OptimizerState
from fedring.training.models import flat_params, flat_sha256
from fedring.training.sharding import ShardError, shard_data


class OutOfSync(ValueError):
    """The node's model after the downlink does not hash to the ServerApp's."""


@dataclass
class NodeState:
    rank: int
    params: torch.Tensor  # the global model as this node holds it (flat float32)
    residual: torch.Tensor  # error feedback (zeros when off)
    rng: torch.Tensor  # the batch sampler's state (`ShardSampler.state_dict`): generator,
    order: torch.Tensor  # the current epoch's permutation (int64),
    pos: int  # the position in it,
    samples_seen: int  # and the samples served
    # `hybrid:L`: this node's own model, lambda * global move + (1 - lambda) * its own
    # move each round (Deng et al.'s adaptive personalisation, fixed or scheduled L),
    # and its own move of the last round, mixed in once the global move arrives.
    personal: torch.Tensor | None = None
    own: torch.Tensor | None = None
    last_round: int = -1  # the last round this node trained (client sampling)
    # the relayed ring: the inner optimizer's state, and DGC's velocity (error feedback's
    # momentum, `momentum_correction`; None when off)
    optimizer: OptimizerState = field(default_factory=OptimizerState)
    ef_velocity: torch.Tensor | None = None


@lru_cache(maxsize=4)
def _plan(spec: JobSpec) -> Plan:
    return build.plan(spec)


def _work(spec: JobSpec, rank: int) -> LocalWork:
    p = _plan(spec)
    model, x, y = _shard_and_model(spec, p, rank)
    return LocalWork(
        model, x, y, p.task.loss,
        ShardSampler(len(x), batch_size=spec.batch_size, seed=spec.seed, rank=rank),
        build.optimizer(spec, p.task, model),
    )  # fmt: skip


def _shard_and_model(
    spec: JobSpec, p: Plan, rank: int
) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """This node's shard and a model to be overwritten by the ServerApp's parameters."""
    x, y = shard_data(p.dataset, p.shards[rank])
    return p.task.model(p.dataset, spec.seed), x, y


def enrol(
    spec: JobSpec, rank: int, table_sha256: str, model_sha256: str,
    initial: torch.Tensor | None = None,
) -> NodeState:  # fmt: skip
    """Verify this node's shard and initial model against the ServerApp's plan: the
    node shards the data itself and its shard table must hash to the ServerApp's
    (`table_sha256`: the table is named, never sent, so enrolment is the same size at
    any N); the start is the `initial` parameters the ServerApp sent, checked by
    sha256 (or, with ``init = "derived"``, this node's own seeded build, refused if it
    differs)."""
    if not 0 <= rank < spec.agents:
        raise ValueError(f"node_config 'partition-id'={rank} not in [0, {spec.agents})")
    if spec.init == "sent" and initial is None:
        raise ValueError("init='sent': the enrol message carries no initial parameters")
    p = _plan(spec)
    if (mine := p.manifest.sha256()) != table_sha256:
        raise ShardError(
            f"node {rank}: its shard table hashes to {mine[:12]}..., the ServerApp's to "
            f"{table_sha256[:12]}...: the dataset or its sharding differs on this node"
        )
    model, _, _ = prepare(
        p.task, p.dataset, p.manifest.entry(rank), p.shards[rank], rank, seed=spec.seed,
        model_sha256=model_sha256, initial=initial if spec.init == "sent" else None,
    )  # fmt: skip
    work = _work(spec, rank)
    work.set_params(flat_params(model))
    zeros = torch.zeros_like(work.params)
    state = _save(work, rank, zeros)
    if Aggregation.parse(spec.aggregation).kind == "hybrid":
        state.personal, state.own = work.params.clone(), zeros.clone()
    return state


def _save(work: LocalWork, rank: int, residual: torch.Tensor) -> NodeState:
    sampler = work.sampler.state_dict()
    return NodeState(
        rank, work.params, residual, sampler["rng"], sampler["order"], sampler["pos"],
        sampler["samples_seen"],
    )  # fmt: skip


def restore(spec: JobSpec, state: NodeState) -> LocalWork:
    """The node's model (at the held parameters), data, loss, sampler and a fresh
    inner optimizer, as they were after the last message."""
    work = _work(spec, state.rank)
    work.set_params(state.params)
    work.sampler.load_state_dict({"rng": state.rng, "order": state.order, "pos": state.pos,
                                  "samples_seen": state.samples_seen})  # fmt: skip
    return work


@dataclass
class RoundResult:
    payload: Payload
    loss: float
    samples: int  # this round's training samples
    compression_error: float


def _compressor(spec: JobSpec) -> GroupTopK | None:
    if spec.compression != "group-topk":
        return None
    return GroupTopK(spec.group_size, spec.k, spec.value_dtype)  # type: ignore[arg-type]


def _round_k(spec: JobSpec, r: int | None) -> int | None:
    """k of round `r` under the job's DGC warm-up and closing flush (as the reducer's
    `DensitySchedule` in-process); None: the codec's own k (no schedule, round unknown)."""
    schedule = DensitySchedule.of(float(spec.density), spec.density_warmup, spec.rounds,
                                  spec.density_flush)  # fmt: skip
    if r is None or spec.compression != "group-topk" or schedule is None:
        return None
    return k_for(schedule.density(r), spec.group_size)


def apply_downlink(state: NodeState, update: Payload | None, params: Payload | None,
                   want_sha256: str) -> None:  # fmt: skip
    """Move the held model to the ServerApp's: a delta added, or whole parameters."""
    if params is not None:
        state.params = params.decompress()
    elif update is not None:
        update.add_to(state.params)
    got = flat_sha256(state.params)
    if got != want_sha256:
        raise OutOfSync(
            f"node {state.rank}: model {got[:12]}... != ServerApp's {want_sha256[:12]}..."
        )


def mix_personal(spec: JobSpec, state: NodeState, global_move: torch.Tensor, r: int) -> None:
    """`hybrid`: move this node's own model by lambda x the global model's move of round
    r plus (1 - lambda) x its own move of that round."""
    if state.personal is None or state.own is None:
        return
    lam = Aggregation.parse(spec.aggregation).lam(r, spec.rounds)
    state.personal.add_(global_move, alpha=lam).add_(state.own, alpha=1.0 - lam)
    state.own.zero_()


def train_round(
    spec: JobSpec, state: NodeState, lr: float, scale: float = 1.0, r: int | None = None
) -> tuple[NodeState, RoundResult]:
    """One round (round `r`, when known) from the held global model (`hybrid`: from
    this node's own model); returns the new state and the update (times `scale`: the
    relayed ring sums, so each node sends its weighted share). A node back from
    sitting out rounds first applies the job's `sit_out` policy to its residual."""
    if r is not None:
        SitOut.parse(spec.sit_out).apply(state.residual, r - state.last_round - 1)
    work = restore(spec, state)
    if state.personal is not None:
        work.set_params(state.personal)
    before = work.sampler.samples_seen
    anchor = work.params.clone()
    if spec.sync == "sync":
        loss, vec = work.gradient()
    else:
        losses = work.steps(spec.local_steps, lr)
        loss, vec = sum(losses) / len(losses), work.params - anchor
        work.set_params(anchor)  # the global model moves only by what all nodes agree on
    if scale != 1.0:
        vec = vec * scale
    ef = None
    if spec.error_feedback:
        ef = ErrorFeedback(vec.numel())
        ef.residual.copy_(state.residual)
    if Aggregation.parse(spec.aggregation).kind == "vote":
        p = ef.compensate(vec) if ef is not None else vec
        payload: Payload = SignQuantizer(4096).compress(p)
        if ef is not None:
            ef.update(payload)
        error = 0.0
    else:
        payload, error = compress_update(vec, _compressor(spec), ef, _round_k(spec, r))
    residual = ef.residual if ef is not None else state.residual
    new = _save(work, state.rank, residual)
    new.last_round = state.last_round if r is None else r
    if state.personal is not None:  # the held model stays the global one
        new.params, new.personal = state.params, anchor
        own = vec * -lr if spec.sync == "sync" else vec
        new.own = own / scale if scale != 1.0 else own
    return new, RoundResult(payload, loss, work.sampler.samples_seen - before, error)


def shard_sizes(spec: JobSpec) -> list[int]:
    """Every shard's size, from this node's own plan (its table's hash was checked)."""
    return list(_plan(spec).manifest.sizes)


def ring_weight(spec: JobSpec, sizes: list[int], members: list[int], rank: int) -> float:
    """This node's share of the ring's sum: 1/N, or its capped manifest weight."""
    if Aggregation.parse(spec.aggregation).kind == "weighted":
        weights = capped_weights([sizes[m] for m in members], spec.weight_cap)
        return float(weights[members.index(rank)])
    return 1.0 / len(members)


def evaluate(spec: JobSpec, state: NodeState) -> tuple[float, float]:
    """Loss and accuracy of the held model (`hybrid`: this node's own) on the test set."""
    p = _plan(spec)
    work = _work(spec, state.rank)
    work.set_params(state.personal if state.personal is not None else state.params)
    return p.task.evaluate(work.model, p.dataset)
