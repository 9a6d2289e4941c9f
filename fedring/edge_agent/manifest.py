"""A coordinator's manifest, read into the `Segment` this agent runs.

The manifest (`coordinator.manifest`) names the job, the epoch, the round to start
from, and of the ring only its size, this agent's rank and the members it exchanges
with. Each field is checked here and a bad one refused, named: a `KeyError`,
`ValueError` or `JobRefused` the daemon answers with a ``nack`` ("refused: ...").
"""

from __future__ import annotations

import math
from typing import Any

from fedring.collective.fanout import COLLECTIVES
from fedring.config import MAX_TIMEOUT_S
from fedring.edge_agent.worker import JobRefused, Segment
from fedring.transport import topics


def read_segment(doc: dict[str, Any], me: str) -> Segment:
    """The segment a manifest hands agent `me`; refused unless `me` is at its rank."""
    seg = Segment(
        job=topics.check_id("job", str(doc["job"])), epoch=int(doc["epoch"]),
        members=ring_view(doc), start_round=int(doc["start_round"]),
        params_sha256=str(doc.get("params_sha256", "")), head=str(doc["head"]),
        max_frame_bytes=int(doc.get("max_frame_bytes", 0)),
        asynchronous=doc.get("mode") == "async", weight=float(doc.get("weight", 0.0)),
        mixed=doc.get("mixed") is True, collective=collective(doc),
        codec=codec(doc), held=doc.get("held") is True, timeout_s=step_timeout(doc),
        barrier=doc.get("barrier") is True,
    )  # fmt: skip
    if seg.members[int(doc["rank"])] != me:
        raise JobRefused(f"{me} is not rank {doc['rank']} of the ring: {doc['peers']}")
    return seg


def ring_view(doc: dict[str, Any]) -> list[str]:
    """The ring as this agent sees it from its manifest: `world` positions, the names
    of the members it exchanges with, a placeholder (``~i``, no agent's id) elsewhere."""
    world, peers = int(doc["world"]), doc["peers"]
    if not isinstance(peers, dict) or not 1 <= world <= 1024:
        raise ValueError(f"manifest: 'world'={world!r}, 'peers' must be a table")
    view = [f"~{i}" for i in range(world)]
    for pos, name in peers.items():
        if not 0 <= int(pos) < world:
            raise ValueError(f"manifest: peer position {pos!r} outside 0..{world - 1}")
        view[int(pos)] = topics.check_id("peer", str(name))
    return view


def collective(doc: dict[str, Any]) -> str:
    """The collective the manifest names for this segment ("" : the job's own)."""
    value = doc.get("collective", "")
    if value not in ("", *COLLECTIVES):
        raise JobRefused(f"manifest field 'collective'={value!r} must be one of {COLLECTIVES}")
    return str(value)


def codec(doc: dict[str, Any]) -> str:
    """The codec the manifest names for this segment: "dense" (compression "auto" chose
    dense fp32) or "" (the job's own)."""
    value = doc.get("codec", "")
    if value not in ("", "dense"):
        raise JobRefused(f"manifest field 'codec'={value!r} must be 'dense' or ''")
    return str(value)


def step_timeout(doc: dict[str, Any]) -> float:
    """Each step's deadline where the coordinator found the job's ``timeout_s`` too short
    for this segment's plan (0: the job's own; it never shortens it)."""
    value = doc.get("timeout_s", 0.0)
    if (isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
            or not 0.0 <= value <= MAX_TIMEOUT_S):  # fmt: skip
        raise JobRefused(f"manifest field 'timeout_s'={value!r} must be a number of seconds "
                         f"in [0, {MAX_TIMEOUT_S:g}]")  # fmt: skip
    return float(value)
