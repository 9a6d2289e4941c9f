"""What the coordinator sends each member at the start of a segment: its manifest.

A manifest is the same size whatever the number of agents: the agent's own row of
the shard table (`ShardEntry`, which names the whole table by its sha256) instead
of the table, and of the ring only the size, the agent's rank and the names of the
members it exchanges with (`collective.torus.contacts`: its ring neighbours, on a
grid each axis's; with ``collective = "fanout"`` every member, with ``"hub"`` the
hub too, and the hub every member) instead of every member, and its weight in the mean (1/N, or
its capped shard-size weight for ``weighted``); then the job spec, the key, and
where the segment starts. The full table and member list stay with the coordinator.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fedring.aggregation.rules import Aggregation, capped_weights
from fedring.collective.torus import contacts
from fedring.coordinator.checkpoint import Checkpoint
from fedring.training.sharding import ShardEntry, ShardError, ShardManifest

# The collectives whose members broadcast to the job's topic: a faster member's round 0
# must not reach the broker before a slower member subscribed (docs/design.md).
BARRIER = ("fanout", "hub")


def segment_docs(
    ck: Checkpoint, members: list[str], epoch: int, start: int, frame_bytes: int,
    mode: str = "ring", mixed: bool = False, collective: str = "", held: str = "", codec: str = "",
    timeout_s: float = 0.0,
) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Each member's manifest for the segment of `members` from round `start`; `mode`
    "async" sends the deltas through the coordinator (an async job or a degraded ring);
    `mixed`: the members run on more than one CPU architecture (`engine.resync`);
    `collective`: the one this segment runs (the job's, or what ``auto`` chose);
    `held`: the sha256 of the state at `start` every member still holds (a re-plan
    resumes there, its optimizer state too: the manifest says ``held``), else the
    checkpoint's (its parameters only); `codec`: "dense" where compression "auto"
    chose dense fp32 for the segment, else "" (the job's codec); `timeout_s`: each step's
    deadline where the job's ``timeout_s`` is too short for this segment's plan, else 0.
    A broadcast collective's manifests say ``barrier``: the members wait for the
    coordinator's go before round 0 (`BARRIER`)."""
    table = ShardManifest.from_dict(ck.shard_manifest)
    entry = shard_entries(table)
    topology, world = str(ck.spec.get("topology", "auto")), len(members)
    weights = [1.0 / world] * world  # each member's share of the mean
    if Aggregation.parse(str(ck.spec.get("aggregation", "mean"))).kind == "weighted":
        sizes = [table.sizes[ck.shards[m]] for m in members]  # capped as `simulate` does
        weights = capped_weights(sizes, float(ck.spec.get("weight_cap", 2.0))).tolist()

    collective = collective or str(ck.spec.get("collective", "ring"))
    collective = "ring" if collective == "auto" else collective  # (unplanned: the ring)

    def peers(rank: int) -> dict[str, str]:
        near = set(contacts(topology, world, rank))
        if collective == "fanout" or (collective == "hub" and rank == 0):
            near = set(range(world))  # hears every member (the hub: their updates)
        elif collective == "hub":
            near.add(0)
        return {str(i): members[i] for i in sorted(near)}

    params_sha256 = held or ck.params_sha256  # once: a hash of the whole model
    return {
        agent: {
            "job": ck.job, "epoch": epoch, "key": ck.key.hex(), "world": world,
            "rank": rank, "peers": peers(rank), "weight": weights[rank],
            "head": members[0], "shard": ck.shards[agent], "spec": ck.spec,
            "shard_entry": entry(ck.shards[agent]),
            "model_sha256": ck.model_sha256, "start_round": start,
            "params_sha256": params_sha256, "max_frame_bytes": frame_bytes,
            "task": ck.task or None, "mode": mode, "mixed": mixed, "collective": collective,
            **({"codec": codec} if codec else {}),
            **({"timeout_s": timeout_s} if timeout_s else {}),
            **({"held": True} if held else {}),
            **({"barrier": True} if collective in BARRIER and mode != "async" else {}),
        }
        for rank, agent in enumerate(members)
    }  # fmt: skip


def shard_entries(table: ShardManifest) -> Callable[[int], dict[str, Any]]:
    """Shard rank -> its row of `table`, as ``table.entry(rank).to_dict()`` but with the
    table's sha256 worked out once: `ShardManifest.entry` hashes the whole table (N
    rows) at every call, N^2 over a segment's N manifests (0.3 s at 1,000 members)."""
    whole = table.sha256()

    def entry(rank: int) -> dict[str, Any]:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < table.n_agents:
            raise ShardError(f"rank {rank!r} out of range 0..{table.n_agents - 1}")
        return ShardEntry(table.dataset, table.scheme, table.seed, table.n_agents, rank,
                          table.sizes[rank], table.digests[rank], whole).to_dict()  # fmt: skip

    return entry
