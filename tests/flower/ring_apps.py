"""A ServerApp and ClientApp that run one relayed ring all-reduce on known inputs.

Node `rank` contributes `ring_input(rank)`; the ServerApp relays the ring and writes
each node's sha256 of the sum (and of what `bounded` kept) to
``$FEDRING_FLOWER_OUT/summary.json``, with the bytes each node moved.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from fedring.compression.group_topk import GroupTopK
from fedring.flower import ring_relay
from fedring.flower.metering import MeteredGrid
from fedring.flower.server_app import wait_for_nodes
from fedring.training.models import flat_sha256

NUMEL = 5000
client = ClientApp()
TOPK = GroupTopK(group_size=256, k=3, value_dtype="fp16")


def ring_input(rank: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(100 + rank))


def members(n: int) -> list[str]:
    return [ring_relay.member_name(i) for i in range(n)]


def _ranks(grid: Grid, nodes: list[int]) -> dict[int, int]:
    """Ask every node its partition id (the ring's order)."""
    msgs = [Message(RecordDict(), dst_node_id=n, message_type="query.rank") for n in nodes]
    return {
        m.metadata.src_node_id: int(m.content.config_records["rank"]["rank"])  # type: ignore[arg-type]
        for m in grid.send_and_receive(msgs, timeout=60.0)
    }


@client.query("rank")
def rank_query(msg: Message, context: Context) -> Message:
    rank = int(context.node_config["partition-id"])
    return Message(RecordDict({"rank": ConfigRecord({"rank": rank})}), reply_to=msg)


@client.train(ring_relay.ACTION)
def ring_step(msg: Message, context: Context) -> Message:
    rank = int(context.node_config["partition-id"])

    def result(_members: list[int], total: torch.Tensor, kept: torch.Tensor) -> dict[str, Any]:
        return {"rank": rank, "sum_sha256": flat_sha256(total), "kept_sha256": flat_sha256(kept)}

    return ring_relay.handle(msg, context, rank, lambda _: TOPK.compress(ring_input(rank)), result)


server = ServerApp()


@server.main()
def main(grid: Grid, context: Context) -> None:
    n = int(os.environ["FEDRING_FLOWER_CLIENTS"])
    metered = MeteredGrid(grid)
    nodes = wait_for_nodes(metered, n, 60.0)
    ranks = _ranks(metered, nodes)
    ring = sorted(((node, ranks[node]) for node in nodes), key=lambda pair: pair[1])
    last = ring_relay.relay(metered, ring, round=0, numel=NUMEL, timeout_s=60.0)
    summary = {
        "status": "completed",
        "by_rank": {int(c["rank"]): [c["sum_sha256"], c["kept_sha256"]] for c in last.values()},  # type: ignore[arg-type]
        "up": {str(k): v for k, v in metered.up.items()},
        "down": {str(k): v for k, v in metered.down.items()},
    }
    out = Path(os.environ["FEDRING_FLOWER_OUT"])
    (out / "summary.json").write_text(json.dumps(summary, sort_keys=True))
