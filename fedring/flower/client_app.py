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
    apply_sum,
    enrol,
    evaluate,
    mix_personal,
    ring_weight,
    shard_sizes,
    train_round,
)
from fedring.training.models import flat_sha256

SERVER = "server"
_ARRAYS, _META, _JOB = "fedring.node", "fedring.meta", "fedring.job"
_RING = "fedring.ring-round"

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
    """One step of a ring relayed by the ServerApp (see `fedring.flower.ring_relay`)."""
    torch.set_num_threads(1)
    spec = spec_from_config(context.state.config_records[_JOB])
    sizes = shard_sizes(spec)
    state = _load(context)
    if "fedring" in msg.content.config_records:  # step 0: this round's lr and evaluation
        context.state[_RING] = ConfigRecord(dict(msg.content.config_records["fedring"]))
    info: Any = context.state.config_records[_RING]
    r = int(msg.content.config_records["ring"]["round"])  # type: ignore[arg-type]

    def make_input(members: list[int]) -> Payload:
        nonlocal state
        retry = ring_relay.unfinished_input(context, r, node_name(state.rank))
        if retry is not None:  # an earlier try of this round broke: its update is not lost
            retry.add_to(state.residual)
        weight = ring_weight(spec, sizes, members, state.rank)
        state, result = train_round(spec, state, float(info["lr"]), scale=weight)
        info["loss"] = result.loss
        return result.payload

    def on_result(total: torch.Tensor, kept: torch.Tensor) -> dict[str, Any]:
        apply_sum(spec, state, total, kept, float(info["lr"]))
        out: dict[str, Any] = {"model_sha256": flat_sha256(state.params), "loss": info["loss"]}
        if info["evaluate"]:
            out["test_loss"], out["accuracy"] = evaluate(spec, state)
        return out

    reply = ring_relay.handle(msg, context, state.rank, make_input, on_result)
    _store(context, state)
    context.state[_RING] = info
    return reply


def _store(context: Context, s: NodeState) -> None:
    arrays = {"params": s.params, "residual": s.residual, "velocity": s.velocity, "rng": s.rng,
              "order": s.order}  # fmt: skip
    if s.personal is not None and s.own is not None:
        arrays.update(personal=s.personal, own=s.own)
    context.state[_ARRAYS] = ArrayRecord({k: Array(v.numpy()) for k, v in arrays.items()})
    context.state[_META] = ConfigRecord(
        {"rank": s.rank, "pos": s.pos, "samples_seen": s.samples_seen, "last_round": s.last_round}
    )


def _load(context: Context) -> NodeState:
    if _ARRAYS not in context.state.array_records:
        raise ValueError("this node was not enrolled in the job (no fedring state)")
    a = context.state.array_records[_ARRAYS]
    m = context.state.config_records[_META]

    def tensor(name: str) -> torch.Tensor:
        return torch.from_numpy(np.array(a[name].numpy()))  # a writable copy

    hybrid = "personal" in a
    return NodeState(
        int(m["rank"]), tensor("params"), tensor("residual"), tensor("velocity"),  # type: ignore[arg-type]
        tensor("rng"), tensor("order"), int(m["pos"]), int(m["samples_seen"]),  # type: ignore[arg-type]
        tensor("personal") if hybrid else None, tensor("own") if hybrid else None,
        int(m.get("last_round", -1)),  # type: ignore[arg-type]
    )  # fmt: skip
