"""fedring's Flower ClientApp: enrol once, then train one round per message.

    flwr.simulation.run_simulation(server_app=..., client_app=fedring.flower.client_app.app, ...)

or, in a Flower app's pyproject: ``clientapp = "fedring.flower.client_app:app"``.
The node's partition comes from its node config (``partition-id``, set by the
simulation engine or ``flower-supernode --node-config "partition-id=0 ..."``).
Everything the node remembers between messages (held model, error-feedback
residual, sampler state, the job) lives in `Context.state`, because the
deployment engine starts a fresh process per message. Payloads travel as
fedring frames (`fedring.flower.carrier`); no pickle anywhere.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from fedring.compression.payload import Payload
from fedring.flower import carrier, ring_relay
from fedring.flower.job import initial_params, spec_from_config
from fedring.flower.node import (
    NodeState,
    OutOfSync,
    apply_downlink,
    enrol,
    evaluate,
    mix_personal,
    ring_weight,
    shard_sizes,
    train_round,
)
from fedring.flower.optimizer_state import OptimizerState
from fedring.flower.ring_member import RingMember
from fedring.training.models import flat_sha256

SERVER = "server"
_ARRAYS, _META, _JOB = "fedring.node", "fedring.meta", "fedring.job"
_RING = "fedring.ring-round"
_OPT = "optimizer/"  # the relayed ring's optimizer state, key by key (`OptimizerState`)

app = ClientApp()


def node_name(rank: int) -> str:
    return f"node-{rank}"


def _partition(context: Context) -> int:
    value = context.node_config.get("partition-id")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"node_config 'partition-id'={value!r} must be an integer")
    return value


@app.query("enrol")
def enrol_node(msg: Message, context: Context) -> Message:
    """Check this node's shard and initial model against the plan; keep the job."""
    torch.set_num_threads(1)  # one Flower worker per core; no intra-op oversubscription
    job = msg.content.config_records["job"]
    plan = msg.content.config_records["plan"]
    spec = spec_from_config(job)
    sent = msg.content.config_records.get("initial")
    initial = initial_params(sent["params"]) if sent is not None else None  # type: ignore[arg-type]
    state = enrol(spec, _partition(context), str(plan["table_sha256"]),
                  str(plan["model_sha256"]), initial)  # fmt: skip
    _store(context, state)
    context.state[_JOB] = ConfigRecord(dict(job))
    reply = ConfigRecord({"rank": state.rank, "samples": shard_sizes(spec)[state.rank]})
    return Message(RecordDict({"enrol": reply}), reply_to=msg)


def _downlink(spec: Any, state: NodeState, cfg: ConfigRecord) -> ConfigRecord | None:
    """Apply round r's downlink (and, with `hybrid`, mix this node's own model);
    return an 'out-of-sync' reply instead when the model hash disagrees."""
    r = int(cfg["round"])  # type: ignore[arg-type]
    kind = str(cfg["kind"])
    got = None
    if kind in ("delta", "params"):
        got = carrier.unpack(list(cfg["frames"]), src=SERVER, dst=node_name(state.rank),  # type: ignore[arg-type]
                             round=r, phase=kind, numel=state.params.numel())  # fmt: skip
    before = state.params.clone() if state.personal is not None else None
    try:
        apply_downlink(state, got if kind == "delta" else None, got if kind == "params" else None,
                       str(cfg["model_sha256"]))  # fmt: skip
    except OutOfSync as exc:
        return ConfigRecord({"round": r, "status": "out-of-sync", "reason": str(exc)})
    if before is not None and r > 0:
        mix_personal(spec, state, state.params - before, r - 1)
    return None


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Apply the downlink, train, reply with the compressed update (or 'out-of-sync')."""
    torch.set_num_threads(1)
    spec = spec_from_config(context.state.config_records[_JOB])
    state = _load(context)
    cfg = msg.content.config_records["fedring"]
    r = int(cfg["round"])  # type: ignore[arg-type]
    me = node_name(state.rank)
    refused = _downlink(spec, state, cfg)
    if refused is not None:
        return Message(RecordDict({"fedring": refused}), reply_to=msg)
    state, result = train_round(spec, state, float(cfg["lr"]), r=r)  # type: ignore[arg-type]
    _store(context, state)
    up = carrier.pack(result.payload, src=me, dst=SERVER, round=r, phase="up")
    # One record: every record and key is a content-addressed object on the wire.
    reply = ConfigRecord({"round": r, "status": "ok", "frames": up, "loss": result.loss})
    return Message(RecordDict({"fedring": reply}), reply_to=msg)


@app.query("evaluate")
def evaluate_node(msg: Message, context: Context) -> Message:
    """After the last round: apply its downlink and test this node's model (`hybrid`:
    its own one, which the ServerApp does not hold)."""
    torch.set_num_threads(1)
    spec = spec_from_config(context.state.config_records[_JOB])
    state = _load(context)
    cfg = msg.content.config_records["fedring"]
    refused = _downlink(spec, state, cfg)
    if refused is not None:
        return Message(RecordDict({"fedring": refused}), reply_to=msg)
    _store(context, state)
    test_loss, acc = evaluate(spec, state)
    reply = ConfigRecord({"round": int(cfg["round"]), "status": "ok",  # type: ignore[arg-type]
                          "test_loss": test_loss, "accuracy": acc})  # fmt: skip
    return Message(RecordDict({"fedring": reply}), reply_to=msg)


@app.train(ring_relay.ACTION)
def ring_round(msg: Message, context: Context) -> Message:
    """One step of a ring relayed by the ServerApp (see `fedring.flower.ring_relay`):
    step 0 trains (`RingMember.update`), the last applies the sum (`RingMember.apply`)."""
    torch.set_num_threads(1)
    spec = spec_from_config(context.state.config_records[_JOB])
    sizes = shard_sizes(spec)
    state = _load(context)
    if "fedring" in msg.content.config_records:  # step 0: whether this round evaluates
        context.state[_RING] = ConfigRecord(dict(msg.content.config_records["fedring"]))
    info: Any = context.state.config_records[_RING]
    r = int(msg.content.config_records["ring"]["round"])  # type: ignore[arg-type]
    me = ring_relay.member_name(state.rank)

    def member(ranks: list[int]) -> RingMember:  # only the steps that train or apply build it
        weight = ring_weight(spec, sizes, ranks, state.rank)
        return RingMember(spec, state, [ring_relay.member_name(m) for m in ranks], me, weight)

    def make_input(ranks: list[int]) -> Payload:
        nonlocal state
        m = member(ranks)
        retry = ring_relay.unfinished_input(context, r, me)
        if retry is not None and m.reducer.ef is not None:  # an earlier try broke: not lost
            retry.add_to(m.reducer.ef.residual)
        payload, info["loss"] = m.update(r)
        state = m.saved()
        return payload

    def on_result(ranks: list[int], total: torch.Tensor, kept: torch.Tensor) -> dict[str, Any]:
        nonlocal state
        m = member(ranks)
        m.apply(r, total, kept)
        state = m.saved()
        out: dict[str, Any] = {"model_sha256": flat_sha256(state.params), "loss": info["loss"]}
        if info["evaluate"]:
            out["test_loss"], out["accuracy"] = evaluate(spec, state)
        return out

    reply = ring_relay.handle(msg, context, state.rank, make_input, on_result)
    _store(context, state)
    context.state[_RING] = info
    return reply


def _store(context: Context, s: NodeState) -> None:
    arrays = {"params": s.params, "residual": s.residual, "rng": s.rng, "order": s.order}
    if s.personal is not None and s.own is not None:
        arrays.update(personal=s.personal, own=s.own)
    if s.ef_velocity is not None:
        arrays["ef_velocity"] = s.ef_velocity
    arrays.update({_OPT + k: v for k, v in s.optimizer.tensors.items()})
    context.state[_ARRAYS] = ArrayRecord({k: Array(v.numpy()) for k, v in arrays.items()})
    meta: dict[str, Any] = {
        "rank": s.rank,
        "pos": s.pos,
        "samples_seen": s.samples_seen,
        "last_round": s.last_round,
        "optimizer_nones": s.optimizer.nones,
    }
    meta.update({_OPT + k: v for k, v in s.optimizer.numbers.items()})
    context.state[_META] = ConfigRecord(meta)


def _load(context: Context) -> NodeState:
    if _ARRAYS not in context.state.array_records:
        raise ValueError("this node was not enrolled in the job (no fedring state)")
    a = context.state.array_records[_ARRAYS]
    m = context.state.config_records[_META]

    def tensor(name: str) -> torch.Tensor:
        return torch.from_numpy(np.array(a[name].numpy()))  # a writable copy

    hybrid = "personal" in a
    optimizer = OptimizerState(
        {k.removeprefix(_OPT): tensor(k) for k in a if k.startswith(_OPT)},
        {k.removeprefix(_OPT): v for k, v in m.items() if k.startswith(_OPT)},  # type: ignore[misc]
        [str(k) for k in m.get("optimizer_nones", [])],  # type: ignore[union-attr]
    )
    return NodeState(
        int(m["rank"]), tensor("params"), tensor("residual"), tensor("rng"), tensor("order"),  # type: ignore[arg-type]
        int(m["pos"]), int(m["samples_seen"]),  # type: ignore[arg-type]
        tensor("personal") if hybrid else None, tensor("own") if hybrid else None,
        int(m.get("last_round", -1)), optimizer,  # type: ignore[arg-type]
        tensor("ef_velocity") if "ef_velocity" in a else None,
    )  # fmt: skip
