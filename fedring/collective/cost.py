"""How long a round's all-reduce takes with each collective: an alpha-beta model.

``collective = "auto"`` picks the collective of a job from this model. Every member
has probed its link to the broker and its own codec (`Probe`): the round trip of a
tiny message through the broker (alpha), its up and down bytes per second (beta),
and the seconds its CPU takes to compress and to decode-and-add `n` entries, fitted
as ``fixed + per_entry * n`` (the fixed part is the per-frame Python work that
dominates small models). For one payload of `payload_bytes` per member (group-top-k
at the job's density, or the dense fp32 vector) the model predicts:

- **ring** (a torus for the layouts that have one): sum over the axes of 2(D-1)
  steps; each step is one broker round trip, a chunk up and a chunk down, and the
  codec work on the chunk (re-select and decode in reduce-scatter, decode in
  all-gather); one step waits for the slowest member.
- **fanout**: one step; each member sends its payload once and receives the other
  N-1 (its downlink carries (N-1) payloads), then decodes all N.
- **hub**: two steps; the hub (rank 0) receives N-1 payloads, decodes and sums
  them, and sends the sum (their union of supports, at most the dense vector) once
  to every member, which decodes it.

A plan ``dense <collective>`` (``compression = "auto"``, `fedring.choose`) is that
collective on the dense vector, each member's codec its dense one (`Probe.dense`: the
per-frame fixed part, `DENSE_ENTRY_S` an entry): fp32 on the ring, the job's value
dtype (fp16 by default: half the bytes) on fan-out and the hub's way up.

Each frame a member takes in also pays ``hop_s``, the cost the probes cannot see (a
frame received by paho, checked, hashed and handed between threads): the coordinator
starts from a prior and learns it from the job's own measured all-reduce
(`coordinator.collectives`). A ring step takes one frame a member; fan-out's one step
N-1 frames a member, all members at once; the hub's gather N-1 frames at the hub alone,
its spread one a member (`hop_units`).

Members that share a machine share its cores (the edge lab's agents, or several agents
on one laptop): ``share`` is a member's co-hosted members over its host's cores, at least
1 (`Fleet.cost_probes`, from the hellos' ``host`` and ``cores``). Work every member does
at once (its codec, the frames it takes in) takes ``share`` times as long; the hub's
gather and combine run while the others wait, so they do not. On a fleet of boards
``share`` is 1. With it the model sees what the lab measured at N = 8 on 2 cores: the
hub, which handles 2(N-1) frames a round, beats fan-out, which handles N(N-1), where the
link is fast (`docs/lab.md`, "Shared cores").

Compute, the head's checkpoint upload and the coordinator's messages are the same
whichever collective runs, so the choice does not depend on them; the caller adds
them to the predicted round for the metrics. The model is deliberately simple: the
job's metrics carry its prediction beside the measured round, so a wrong choice
shows (`docs/lab.md`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from fedring.collective.torus import layout_dims

ALGORITHMS = ("ring", "fanout", "hub")  # in the order ties are broken
# A dense fp32 entry's CPU: copied into a frame, or added into the sum (a.add_(b) on
# 1M entries, the 2-core AMD EPYC sandbox under load: 2.5 ns an entry)
DENSE_ENTRY_S = 2.5e-9
DENSE = "dense "  # a plan's prefix: the dense fp32 codec (`compression = "auto"`)


@dataclass(frozen=True)
class Probe:
    """One member's measured link and codec; a figure <= 0 is unknown."""

    rtt_s: float = 0.0  # a tiny message to the broker and back
    up_bps: float = 0.0  # bytes per second towards the broker
    down_bps: float = 0.0  # bytes per second from the broker
    encode_s: tuple[float, float] = (0.0, 0.0)  # compress n entries: fixed + per entry
    decode_s: tuple[float, float] = (0.0, 0.0)  # decode n entries and add them
    hop_s: float = 0.0  # each frame taken in: its cost beyond its bytes, learned in the job
    share: float = 1.0  # members on this member's host over its cores, at least 1

    # Each CPU cost below is what the work takes while every member does it at once
    # (`load` times its own), or `alone` while the others wait (the hub's gather).

    def encode(self, n: float, alone: bool = False) -> float:
        """Compress `n` entries."""
        return self._cpu(max(self.encode_s[0], 0.0) + max(self.encode_s[1], 0.0) * n, alone)

    def decode(self, n: float, alone: bool = False) -> float:
        """Decode `n` entries and add them."""
        return self._cpu(max(self.decode_s[0], 0.0) + max(self.decode_s[1], 0.0) * n, alone)

    def frames(self, n: float, alone: bool = False) -> float:
        """Take in `n` frames, `hop_s` each."""
        return self._cpu(max(self.hop_s, 0.0) * n, alone)

    @property
    def load(self) -> float:
        return max(self.share, 1.0)

    def _cpu(self, seconds: float, alone: bool) -> float:
        return seconds if alone else seconds * self.load

    def up(self, nbytes: float) -> float:
        return nbytes / self.up_bps if self.up_bps > 0 else 0.0

    def down(self, nbytes: float) -> float:
        return nbytes / self.down_bps if self.down_bps > 0 else 0.0

    def dense(self) -> Probe:
        """This member sending dense fp32: no selection, decode is a vector add; the
        per-frame fixed part stays (a frame is built and read either way). Never more
        an entry than its group-top-k (which reads every entry too), and unknown where
        that is unknown."""
        enc, dec = self.encode_s, self.decode_s
        return replace(self, encode_s=(enc[0], min(enc[1], DENSE_ENTRY_S)),
                       decode_s=(dec[0], min(dec[1], DENSE_ENTRY_S)))  # fmt: skip


@dataclass(frozen=True)
class Workload:
    """What one round all-reduces: `numel` entries, `payload_bytes` per member on the
    wire, and the sum of N payloads at most `dense_bytes` (the hub sends the smaller)."""

    numel: int
    payload_bytes: float
    dense_bytes: float
    topology: str = "auto"
    # one member's dense vector as a one-step plan sends it (the job's value dtype,
    # `engine.reducer.Reducer.dense_wire`); 0: `dense_bytes`
    dense_wire_bytes: float = 0.0


def collective_of(plan: str) -> str:
    """The collective of a plan: "ring" of "ring" and of "dense ring"."""
    return plan.removeprefix(DENSE)


def codec_of(plan: str, compression: str = "group-topk") -> str:
    """The codec of a plan: "dense" for a dense plan, else the job's `compression`."""
    return "dense" if plan.startswith(DENSE) else compression


@dataclass(frozen=True)
class Choice:
    algorithm: str  # the chosen plan: a collective, or DENSE + a collective
    predicted_s: dict[str, float]  # every candidate's predicted all-reduce seconds
    # each candidate's mean all-reduce over the rounds the plan holds before it is
    # checked (the density warm-up's payloads included); empty: `predicted_s`
    horizon_s: dict[str, float] = field(default_factory=dict)

    def expected(self, plan: str) -> float:
        """What a plan is chosen by: its mean over the horizon, else its prediction."""
        return self.horizon_s.get(plan, self.predicted_s[plan])

    @property
    def collective(self) -> str:
        return collective_of(self.algorithm)

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "chosen": self.algorithm,
            "predicted_s": {k: round(v, 6) for k, v in self.predicted_s.items()},
        }
        if self.horizon_s:
            out["horizon_s"] = {k: round(v, 6) for k, v in self.horizon_s.items()}
        return out


def ring_seconds(probes: list[Probe], work: Workload) -> float:
    """Reduce-scatter and all-gather over each axis of the layout (`collective.torus`)."""
    world = len(probes)
    if world < 2:
        return 0.0
    total, share, entries = 0.0, work.payload_bytes, float(work.numel)
    total += max(p.encode(entries) for p in probes)  # each member compresses its gradient
    for d in layout_dims(work.topology, world) or (world,):
        share, entries = share / d, entries / d
        step = max(p.rtt_s + p.frames(1) + p.up(share) + p.down(share) for p in probes)
        reduce = max(p.decode(entries) + p.encode(entries) for p in probes)
        gather = max(p.decode(entries) for p in probes)
        total += (d - 1) * (2 * step + reduce + gather)
    return total


def fanout_seconds(probes: list[Probe], work: Workload) -> float:
    world = len(probes)
    if world < 2:
        return 0.0
    send = max(p.encode(work.numel) + p.up(work.payload_bytes) for p in probes)
    take = max(p.rtt_s + p.frames(world - 1) + p.down((world - 1) * work.payload_bytes)
               + world * p.decode(work.numel) for p in probes)  # fmt: skip
    return send + take


def hub_seconds(probes: list[Probe], work: Workload) -> float:
    world = len(probes)
    if world < 2:
        return 0.0
    hub, members = probes[0], probes[1:]
    summed = min(world * work.payload_bytes, work.dense_bytes)
    send = max(p.encode(work.numel) + p.up(work.payload_bytes) for p in members)
    gather = (hub.rtt_s + hub.frames(world - 1, alone=True)
              + hub.down((world - 1) * work.payload_bytes))  # fmt: skip
    combine = world * hub.decode(work.numel, alone=True) + hub.encode(work.numel, alone=True)
    spread = hub.up(summed) + max(p.rtt_s + p.frames(1) + p.down(summed) + p.decode(work.numel)
                                  for p in members)  # fmt: skip
    return send + gather + combine + spread


def steps(algorithm: str, world: int, topology: str = "auto") -> int:
    """Sequential broker steps of one all-reduce (each pays a round trip)."""
    algorithm = collective_of(algorithm)
    if world < 2:
        return 0
    if algorithm == "ring":
        return sum(2 * (d - 1) for d in layout_dims(topology, world) or (world,))
    return {"fanout": 1, "hub": 2}[algorithm]


def hop_units(algorithm: str, probes: list[Probe], topology: str = "auto") -> float:
    """How many times one all-reduce of `algorithm` pays `Probe.hop_s` on its critical
    path (`ring_seconds`, `fanout_seconds`, `hub_seconds`): what the coordinator spreads
    a measured excess over."""
    world = len(probes)
    if world < 2:
        return 0.0
    load = max(p.load for p in probes)
    algorithm = collective_of(algorithm)
    if algorithm == "ring":
        return steps("ring", world, topology) * load
    if algorithm == "fanout":
        return (world - 1) * load
    return (world - 1) + load  # the hub's gather alone, its spread one frame a member


SECONDS = {"ring": ring_seconds, "fanout": fanout_seconds, "hub": hub_seconds}


def predict(algorithm: str, probes: list[Probe], work: Workload) -> float:
    """The all-reduce of plan `algorithm`; a dense plan sends `work.dense_bytes` a member
    (a one-step one `work.dense_wire_bytes`, where known) with each member's dense codec
    (`Probe.dense`)."""
    if algorithm.startswith(DENSE):
        probes = [p.dense() for p in probes]
        one_step = collective_of(algorithm) != "ring" and work.dense_wire_bytes > 0
        work = replace(work, payload_bytes=work.dense_wire_bytes if one_step else work.dense_bytes)
    return SECONDS[collective_of(algorithm)](probes, work)


def choose(probes: list[Probe], work: Workload, candidates: tuple[str, ...] = ALGORITHMS) -> Choice:
    """The candidate with the smallest predicted all-reduce; ties go to the earlier one."""
    predicted = {a: predict(a, probes, work) for a in candidates}
    best = min(candidates, key=lambda a: (predicted[a], candidates.index(a)))
    if not all(math.isfinite(v) for v in predicted.values()):
        best = candidates[0]
    return Choice(best, predicted)
