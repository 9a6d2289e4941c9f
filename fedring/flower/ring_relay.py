"""The ring over Flower: the ServerApp relays each node's chunk to its right neighbour.

Flower nodes only talk to the ServerApp, so the ring's point-to-point sends become
relayed messages, one round trip per ring step: in step s every node gets the
frames its left neighbour sent in step s-1 and answers with the frames it sends in
step s. After 2(N-1) steps (reduce-scatter, then all-gather) and one last delivery
every node holds the sum. Each node sends and receives exactly the ring's chunks,
2(N-1)/N of one compressed vector a round, plus Flower's per-message overhead.

A node may run each message in a fresh process, so it cannot keep a `Ring` waiting
between messages. Instead it *replays*: every message runs the unchanged
`fedring.collective.Ring` code from the start over a `Mailbox` holding the frames
received so far. Ring steps are deterministic, so the replay re-creates the frames
already sent bit for bit, stops where the next frame has not arrived yet, and
returns only the new ones. The result is therefore the in-process ring's result,
by the same code on the same inputs; `tests/flower/test_ring_relay.py` checks it.
The price is compute, not bytes: step s replays s steps, so a round costs about
N² chunk operations per node instead of N (small next to training for the boards'
models; a node process that stays alive could keep its `Ring` instead).

A node that fails or stays silent breaks the ring for that round: `relay` raises
`RingBroken` naming it (the caller re-forms the ring from the survivors or fails
the run), never waits past its deadline.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from fedring.collective.channel import CollectiveError, PeerChannel
from fedring.collective.ring import Ring, SparsePolicy
from fedring.compression.payload import Payload
from fedring.compression.quantize import DenseChunk
from fedring.compression.sparse import SparseGroups
from fedring.flower import carrier
from fedring.transport.base import Delivery
from fedring.wire.compact import decode_compact

ACTION = "ring"  # message type "train.ring"
_STATE = "fedring.ring"


class RingBroken(RuntimeError):
    """A node failed or stayed silent in a relayed ring step."""

    def __init__(self, node: int, step: int, reason: str) -> None:
        super().__init__(f"node {node} broke the ring at step {step}: {reason}")
        self.node, self.step = node, step


@dataclass
class StepOutput:
    frames: list[bytes]  # frames this node sends in this step (to its right neighbour)
    result: tuple[torch.Tensor, torch.Tensor] | None  # (sum, kept) once the ring is done


def node_step(
    members: Sequence[str],
    position: int,
    own: Payload,
    received: list[bytes],
    sent_before: int,
    round: int,
    policy: SparsePolicy = "bounded",
) -> StepOutput:
    """Replay this node's ring over the frames `received` so far (see module doc)."""
    me, left = members[position], members[(position - 1) % len(members)]
    box = carrier.Mailbox(me, left)
    box.inbox.extend(Delivery(left, f) for f in received)
    ring = Ring(PeerChannel(box, carrier.JOB), tuple(members), timeout_s=0.0)
    result: tuple[torch.Tensor, torch.Tensor] | None = None
    try:
        if isinstance(own, SparseGroups):
            result = ring.allreduce_sparse(own, policy=policy, round=round)
        elif isinstance(own, DenseChunk):
            total = ring.allreduce_dense(own.decompress(), round=round)
            result = (total, torch.zeros_like(total))
        else:
            raise TypeError(f"the relayed ring takes group-topk or dense payloads, not {own!r}")
    except CollectiveError:
        pass  # the next frame from the left has not arrived: this step is done
    return StepOutput(box.outbox[sent_before:], result)


def member_name(rank: int) -> str:
    return f"node-{rank}"


def handle(
    msg: Message,
    context: Context,
    rank: int,
    make_input: Callable[[list[int]], Payload],
    on_result: Callable[[list[int], torch.Tensor, torch.Tensor], dict[str, Any]],
) -> Message:
    """One relayed step on the node (inside a ClientApp's ``train.ring`` function).

    The message names the ring (`members`: ranks in ring order, which may be the
    survivors of a broken ring). Step 0 calls ``make_input(members)`` (e.g. compress
    this round's update, scaled by 1/len(members), with error feedback) and keeps it,
    as frames, in `Context.state`; the last step calls ``on_result(members, sum,
    kept)`` (e.g. apply the sum), whose values ride in the last reply.
    """
    cfg: Any = msg.content.config_records["ring"]
    r, step, numel = int(cfg["round"]), int(cfg["step"]), int(cfg["numel"])
    ranks = [int(m) for m in cfg["members"]]
    if rank not in ranks:
        raise ValueError(f"rank {rank} is not in the ring {ranks}")
    members = [member_name(m) for m in ranks]
    me = member_name(rank)
    if step == 0:
        own_frames = carrier.pack(make_input(ranks), src=me, dst=me, round=r, phase="own")
        received: list[bytes] = []
        sent = 0
    else:
        kept: Any = context.state.config_records[_STATE]
        if kept["round"] != r:
            raise ValueError(
                f"ring step {step} of round {r}, but this node is in {kept['round']!s}"
            )
        own_frames, received, sent = list(kept["own"]), list(kept["received"]), int(kept["sent"])
    received += list(cfg["frames"])
    own = carrier.unpack(own_frames, src=me, dst=me, round=r, phase="own", numel=numel)
    position = ranks.index(rank)
    out = node_step(members, position, own, received, sent, r, str(cfg["policy"]))  # type: ignore[arg-type]
    context.state[_STATE] = ConfigRecord({"own": own_frames, "received": received, "round": r,
                                          "sent": sent + len(out.frames),
                                          "done": out.result is not None})  # fmt: skip
    reply = ConfigRecord(
        {"round": r, "step": step, "rank": rank, "frames": out.frames, "done": False}
    )
    if out.result is not None:
        reply["done"] = True
        reply.update(on_result(ranks, *out.result))
    return Message(RecordDict({"ring": reply}), reply_to=msg)


def unfinished_input(context: Context, round: int, me: str) -> Payload | None:
    """This node's input to an earlier, broken try of `round` (to put back into its
    error feedback before the retry), or None."""
    kept: Any = context.state.config_records.get(_STATE)
    if kept is None or kept["round"] != round or kept["done"]:
        return None
    own = list(kept["own"])
    return carrier.unpack(own, src=me, dst=me, round=round, phase="own", numel=_numel(own, me))


def _numel(frames: list[bytes], me: str) -> int:
    return int(decode_compact(frames[0], job=carrier.JOB, src=me, dsts=(me,)).meta["numel"])


def relay(
    grid: Grid,
    ring: Sequence[tuple[int, int]],
    round: int,
    numel: int,
    timeout_s: float,
    policy: str = "bounded",
    extra: dict[int, ConfigRecord] | None = None,
) -> dict[int, ConfigRecord]:
    """Drive one ring all-reduce over `ring`, (node id, rank) pairs in ring order;
    return each node's last reply (with what its `on_result` added).

    `extra[node]` rides along with step 0. A failed, silent or confused node raises
    `RingBroken` at the step where it happened.
    """
    n = len(ring)
    steps = 2 * (n - 1)
    ranks = [rank for _, rank in ring]
    deliver: dict[int, list[bytes]] = {node: [] for node, _ in ring}
    last: dict[int, ConfigRecord] = {}
    for step in range(steps + 1):
        msgs = []
        for node, _ in ring:
            cfg = ConfigRecord({"round": round, "step": step, "numel": numel, "policy": policy,
                                "members": ranks, "frames": deliver[node]})  # fmt: skip
            content = RecordDict({"ring": cfg})
            if step == 0 and extra and node in extra:
                content["fedring"] = extra[node]
            msgs.append(Message(content, dst_node_id=node,
                                message_type=f"{MessageType.TRAIN}.{ACTION}"))  # fmt: skip
        replies = {
            m.metadata.src_node_id: m for m in grid.send_and_receive(msgs, timeout=timeout_s)
        }
        for i, (node, rank) in enumerate(ring):
            last[node] = _check(replies.get(node), node, rank, step, steps)
            deliver[ring[(i + 1) % n][0]] = list(last[node]["frames"])  # type: ignore[arg-type]
    return last


def _check(reply: Message | None, node: int, rank: int, step: int, steps: int) -> ConfigRecord:
    if reply is None:
        raise RingBroken(node, step, "no reply before the step's deadline")
    if reply.has_error():
        raise RingBroken(node, step, str(reply.error.reason))
    got = reply.content.config_records["ring"]
    if (
        got.get("step") != step
        or got.get("rank") != rank
        or bool(got.get("done")) != (step == steps)
    ):
        raise RingBroken(
            node, step, f"answered step {got.get('step')!s} as rank {got.get('rank')!s}"
        )
    return got
