"""The virtual clock of `fedring simulate --fleet ... --pipeline-stages S`: a fleet's
wall time for the S x D grid, bubble included.

Per step, with stage s on boards s*D .. s*D+D-1 (its slowest board counts):

- each stage's forward and backward of one micro-batch = the seconds measured on this
  host (its thread's CPU time) x host GFLOPS / the board's HPL GFLOPS;
- one hop between stages = one exchange through the broker of the micro-batch's
  activation bytes among the two stages' boards (`sim.fleet.step_seconds`: link
  latency both ways, bandwidth, a shared Wi-Fi channel, the broker's port); the
  slowest boundary counts for every hop;
- the schedule is replayed with those times (`pipeline.schedule.timeline`), giving
  the step's makespan and the fleet's bubble fraction;
- then every stage's ring runs at once (after the flush): ring steps x one step of
  its payload per step among the stage's boards, plus its compression CPU time
  scaled like compute; the slowest stage's ring counts.

Transfers overlap nothing here, so this is a conservative estimate.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from fedring.collective.torus import layout_name
from fedring.config import JobSpec
from fedring.pipeline.schedule import timeline
from fedring.sim.fleet import DEFAULT_TARGET, Member, ring_steps, step_seconds


def estimate_pipeline(
    spec: JobSpec, summary: dict[str, Any], fleet: list[Member]
) -> dict[str, Any]:
    """Add ``sim_seconds`` to every row and return the fleet's totals for the summary."""
    s_count = spec.pipeline_stages
    d = spec.agents // s_count
    host = float(summary["plan"]["host_gflops"])
    costs = summary["stage_costs"]
    boards = [fleet[s * d : (s + 1) * d] for s in range(s_count)]
    speed = [host / min(m.profile.gflops for m in own) for own in boards]
    fwd = [c["forward_s"] * k for c, k in zip(costs, speed, strict=True)]
    bwd = [c["backward_s"] * k for c, k in zip(costs, speed, strict=True)]
    hop = max((step_seconds(boards[s] + boards[s + 1], costs[s]["activation_bytes"])
               for s in range(s_count - 1)), default=0.0)  # fmt: skip
    line = timeline(spec.pipeline_schedule, fwd, bwd, micro_batches=spec.micro_batches, hop_s=hop)
    steps = ring_steps(layout_name(spec.topology, d), d) if d > 1 else 0
    ring = max(
        c["ring_compute_s"] * k
        + (steps * step_seconds(own, c["ring_payload_bytes_per_step"] / steps) if steps else 0.0)
        for c, k, own in zip(costs, speed, boards, strict=True)
    )
    step = line.makespan_s + ring
    for row in summary["rows"]:
        row["sim_seconds"] = (row["round"] + 1) * step
    target = spec.target_accuracy or DEFAULT_TARGET
    reached = next((r for r in summary["rows"] if r.get("accuracy", -1.0) >= target), None)
    return {
        "fleet": ",".join(f"{k}:{v}" for k, v in Counter(m.label for m in fleet).items()),
        "sim_seconds": summary["rounds"] * step,
        "sim_step_seconds": step,
        "sim_bubble_fraction": line.bubble,
        "sim_hop_seconds": hop,
        "sim_ring_seconds_per_step": ring,
        "sim_target_accuracy": target,
        "sim_rounds_to_target": reached["round"] if reached else None,
        "sim_seconds_to_target": reached["sim_seconds"] if reached else None,
    }
