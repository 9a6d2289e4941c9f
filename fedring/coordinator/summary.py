"""The job's `summary.json`, assembled from what the coordinator gathered.

A pure function of plain values: the last epoch (its members and their byes), the
job's events and counters, the fleet's probes, the link's byte counts, an
asynchronous job's centre. `coordinator.service` gathers them (checking the models'
hashes and exporting ONNX first, so the counters are final) and writes the result
with `outputs.write`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedring.collective.torus import layout_name
from fedring.coordinator.epoch import Epoch
from fedring.coordinator.membership import Fleet, number


@dataclass(frozen=True)
class Centre:
    """An asynchronous job's centre at the end: its rounds are its versions."""

    version: int
    staleness: dict[int, int]


SPLIT = ("ring", "checkpoint", "control")  # what a member's `link` bytes went to


def sent_split(bye: dict[str, Any]) -> dict[str, int]:
    """Every byte a member published in the job (`link`) and what it went to: the
    collective's frames (`ring`, a star's exchanges included), the checkpoint stream
    (the head's dense uploads, the members' patches) and the rest (`control`:
    metrics rows, acks, nacks). number(): a member's string would raise."""
    link = int(number(bye.get("link_bytes_sent")))
    ring = int(number(bye.get("ring_bytes_sent")))
    checkpoint = int(number(bye.get("checkpoint_bytes_sent")))
    return {"ring": ring, "checkpoint": checkpoint,
            "control": max(link - ring - checkpoint, 0), "link": link}  # fmt: skip


def model_hashes(ep: Epoch) -> list[str]:
    """The distinct model hashes the members' byes carry, sorted (one: identical)."""
    return sorted({str(d.get("sha256")) for d in ep.done.values()})


def describe_layout(asynchronous: bool, topology: str, collective: str, n: int) -> str:
    """How the last epoch's `n` members exchanged, in words."""
    if asynchronous:
        return "async star"
    if topology == "star":
        return f"star of {n}"
    if collective != "ring":
        return f"{collective} of {n}"
    return layout_name(topology, n)


def assemble(
    *, job: str, ep: Epoch, reformations: int, events: list[dict[str, Any]], fleet: Fleet,
    drift: dict[str, object], wall_s: float, checkpoint: str, checkpoint_round: int,
    counters: dict[str, int], bytes_received: int, bytes_sent: int, centre_rounds: int,
    degraded: int, centre: Centre | None, onnx: dict[str, Any] | None, layout: str,
    collective: list[dict[str, Any]],
) -> dict[str, Any]:  # fmt: skip
    """The summary of a job whose last epoch is `ep`; `centre` is given for a job that
    ended asynchronously (its rounds are the centre's versions, not agents' cycles);
    `onnx` is the export's result, None when not exported."""
    hashes = model_hashes(ep)
    head = ep.done.get(ep.members[0]) or next(iter(ep.done.values()))
    agent_bytes = {a: sent_split(d) for a, d in ep.done.items()}
    summary: dict[str, Any] = {
        "job": job,
        "final_accuracy": head.get("accuracy", 0.0),
        "test_loss": head.get("test_loss", 0.0),
        "rounds": head.get("rounds", 0),
        "members": ep.members,
        "model_hashes": hashes,
        "identical_models": len(hashes) == 1,
        "epochs": ep.number + 1,
        "reformations": reformations,
        "events": events,
        "agent_threads": {a: int(number(d.get("threads"))) for a, d in ep.done.items()},
        "machines": {a: fleet.machine(a) for a in ep.members},
        "drift": drift,
        "probe": fleet.probes(ep.members),
        "round_estimate_s": fleet.round_estimate(ep.members),
        "wall_seconds": wall_s,
        "checkpoint": checkpoint,
        "coordinator_counters": counters,
        "agent_counters": {a: d.get("counters", {}) for a, d in ep.done.items()},
        "bytes_received_by_coordinator": bytes_received,
        "bytes_sent_by_coordinator": bytes_sent,
        "centre_rounds": centre_rounds,
        "lost": sorted(ep.gone),
        "agent_bytes": agent_bytes,
        "checkpoint_round": checkpoint_round,
        "degraded": degraded,
    }
    if centre is not None:
        summary["rounds"] = centre.version
        summary["staleness"] = {str(k): v for k, v in sorted(centre.staleness.items())}
    if onnx is not None:
        summary["onnx"] = onnx
    n = max(len(agent_bytes), 1)
    summary["bytes_sent_per_agent"] = sum(b["link"] for b in agent_bytes.values()) / n
    summary["bytes_sent_per_agent_split"] = {
        part: sum(b[part] for b in agent_bytes.values()) / n for part in SPLIT
    }
    summary["layout"] = layout
    summary["collective"] = collective
    return summary
