"""`collective = "auto"`: the job's collective for these members, from their probes.

The runners call `choose_collective` when a ring forms (the coordinator again each
time it re-forms): it states the job's round as a `collective.cost.Workload`
(entries, one member's payload on the wire, the dense vector) and lets the cost
model pick among the collectives the job may use. A job that may only use the ring
(a torus topology, a star, asynchronous rounds, a sign vote, a pipeline) gets the
ring without a prediction of the others.
"""

from __future__ import annotations

import torch

from fedring.aggregation.rules import Aggregation
from fedring.collective.cost import ALGORITHMS, Choice, Probe, Workload, choose, predict
from fedring.compression.group_topk import GroupTopK
from fedring.config import JobSpec

HEADER_BYTES = 64  # a compact frame's header is at most this (`wire.compact`)
_MAX_SAMPLE = 1 << 20  # payload size measured on at most this many entries, then scaled


def candidates(spec: JobSpec) -> tuple[str, ...]:
    """The collectives this job may use (`config._check_collective`'s rule)."""
    one_step = (spec.topology in ("auto", "ring") and spec.sync != "async"
                and Aggregation.parse(spec.aggregation).kind in ("mean", "weighted")
                and spec.pipeline_stages == 1)  # fmt: skip
    return ALGORITHMS if one_step else ("ring",)


def payload_bytes(spec: JobSpec, numel: int) -> float:
    """One member's gradient on the wire: group-top-k at the job's density (measured on
    a sample of the vector and scaled) or the dense fp32 vector, plus a frame header."""
    if spec.compression != "group-topk" or numel == 0:
        return 4.0 * numel + HEADER_BYTES
    sample = min(numel, _MAX_SAMPLE)
    sample -= sample % spec.group_size if sample > spec.group_size else 0
    codec = GroupTopK.from_density(spec.density, spec.group_size, spec.value_dtype)  # type: ignore[arg-type]
    x = torch.randn(sample, generator=torch.Generator().manual_seed(0))
    return codec.compress(x).wire_nbytes * numel / sample + HEADER_BYTES


def workload(spec: JobSpec, numel: int) -> Workload:
    return Workload(numel, payload_bytes(spec, numel), 4.0 * numel + HEADER_BYTES,
                    spec.topology)  # fmt: skip


def in_process_probes(world: int) -> list[Probe]:
    """`fedring simulate`'s members: this machine's codec, and no link to pay for (the
    in-process transport has neither latency nor a bandwidth limit)."""
    from fedring.compression.probe import codec_cost

    encode_s, decode_s = codec_cost()
    return [Probe(encode_s=encode_s, decode_s=decode_s)] * world


def choose_collective(spec: JobSpec, numel: int, probes: list[Probe]) -> Choice:
    """The job's own collective, or under ``auto`` the fastest predicted for `probes`
    (one per member, in ring order: rank 0 is the hub)."""
    work = workload(spec, numel)
    if spec.collective != "auto":
        return Choice(spec.collective, {spec.collective: predict(spec.collective, probes, work)})
    return choose(probes, work, candidates(spec))
