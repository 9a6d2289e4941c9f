"""``compression = "auto"``: the plan chooses the codec with the collective
(`fedring.choose`): dense fp32 where the link is fast and the codec costly, group-top-k
where the link is the bottleneck, never predicted slower than the dense ring; and the
reducer's switch to dense flushes what error feedback held back."""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch

from fedring.choose import (
    HEADER_BYTES,
    RING_FREE_STEPS,
    RING_STEP,
    ROUNDS_AT_FLOOR,
    choose_collective,
    choose_plan,
    choosing,
    plans,
    rounds_factor,
    to_target,
    workload,
)
from fedring.collective import PeerChannel
from fedring.collective.cost import DENSE, Probe, codec_of, collective_of, predict
from fedring.collective.fanout import Fanout, Hub
from fedring.collective.ring import Ring
from fedring.collective.torus import Torus
from fedring.compression.policy import choose_density
from fedring.config import JobSpec, SpecError
from fedring.engine.reducer import Reducer, ReducerSettings
from fedring.transport.inproc import InprocTransport

NUMEL = 5210  # the MNIST-1D CNN
# group-top-k as `codec_cost()` measured it on the loaded 2-core sandbox (4.6e-7 s an entry)
COSTLY = dict(encode_s=(2e-4, 4e-7), decode_s=(5e-5, 1e-8))


def job(**fields: object) -> JobSpec:
    return JobSpec.from_mapping({"agents": 4, "dataset": "mnist1d", "model": "cnn",
                                 "rounds": 200, "compression": "auto", **fields})  # fmt: skip


def probes(mbit_s: float, rtt_s: float = 0.0005) -> list[Probe]:
    bps = mbit_s * 1e6 / 8
    return [Probe(rtt_s=rtt_s, up_bps=bps, down_bps=bps, **COSTLY)] * 4  # type: ignore[arg-type]


def test_compression_auto_resolves_to_the_policy_density_and_leaves_other_jobs_alone() -> None:
    spec = job()
    assert spec.compression == "group-topk" and spec.compression_auto
    # the codec choice trades time, not accuracy: group-top-k at the policy's density
    assert spec.density == choose_density(rounds=200).density
    assert spec.codec_choice()["compression"] == "auto"
    plain = JobSpec.from_mapping({"agents": 4, "rounds": 200})
    assert not plain.compression_auto and plans(plain) == ("ring",) and not choosing(plain)
    assert plans(plain.replace(collective="auto")) == ("ring", "fanout", "hub")
    assert plans(spec) == ("dense ring", "ring")
    assert plans(job(collective="auto")) == (
        "dense ring",
        "dense fanout",
        "dense hub",
        "ring",
        "fanout",
        "hub",
    )
    assert plans(job(collective="fanout")) == ("dense fanout", "fanout")
    assert plans(job(topology="star", aggregation="median")) == ("ring",)  # no dense star
    # the resolved spec reads back as itself (what the coordinator sends the agents)
    assert JobSpec.from_mapping(spec.resolved()) == spec
    with pytest.raises(SpecError, match="'compression'='zip'"):
        job(compression="zip")


def test_a_fast_link_and_a_costly_codec_choose_dense() -> None:
    choice = choose_plan(job(), NUMEL, probes(1000.0, rtt_s=0.0))
    assert choice.algorithm == "dense ring" and choice.collective == "ring"
    assert choice.predicted_s["dense ring"] < choice.predicted_s["ring"]
    # with the collective chosen too: one step beats six, and dense beats group-top-k
    choice = choose_plan(job(collective="auto"), NUMEL, probes(1000.0, rtt_s=0.0))
    assert choice.algorithm == "dense fanout" and codec_of(choice.algorithm) == "dense"


def test_a_slow_link_chooses_group_topk() -> None:
    choice = choose_plan(job(collective="auto"), NUMEL, probes(1.0))
    assert not choice.algorithm.startswith(DENSE)
    assert codec_of(choice.algorithm) == "group-topk"
    assert choice.predicted_s[choice.algorithm] < choice.predicted_s["dense ring"] / 2


@pytest.mark.parametrize("collective", ["auto", "ring"])
def test_never_predicted_slower_than_the_dense_ring(collective: str) -> None:
    spec = job(collective=collective)
    for mbit, rtt, numel, enc in itertools.product(
        (0.5, 10.0, 100.0, 10_000.0), (0.0, 0.001, 0.05), (1_000, NUMEL, 1_000_000),
        (0.0, 1e-8, 1e-6),
    ):  # fmt: skip
        bps = mbit * 1e6 / 8
        p = [Probe(rtt_s=rtt, up_bps=bps, down_bps=bps, encode_s=(1e-4, enc),
                   decode_s=(5e-5, enc / 4))] * 4  # fmt: skip
        choice = choose_plan(spec, numel, p)
        dense = choice.predicted_s[f"{DENSE}ring"]
        assert choice.predicted_s[choice.algorithm] <= dense, (mbit, rtt, numel, enc)
        assert collective_of(choice.algorithm) in ("ring", "fanout", "hub")


def test_group_topk_is_charged_the_extra_rounds_it_needs_to_reach_the_target() -> None:
    """Time to target, not a round: at 1% group-top-k on a one-step collective needs
    `ROUNDS_AT_FLOOR` x dense's rounds, less the denser it is; a dense plan, 1. A job
    that sends dense (``compression = "none"``) has nothing to weigh: 1."""
    assert rounds_factor(job(density=0.01), "fanout") == pytest.approx(ROUNDS_AT_FLOOR)
    assert rounds_factor(job(density=0.01), "hub") == pytest.approx(ROUNDS_AT_FLOOR)
    assert rounds_factor(job(density=0.01), "dense ring") == 1.0
    assert 1.0 < rounds_factor(job(density=0.075), "fanout") < rounds_factor(job(), "fanout")
    dense = JobSpec.from_mapping({"agents": 4, "rounds": 200, "compression": "none"})
    assert rounds_factor(dense, "ring") == 1.0


def test_the_bounded_rings_extra_rounds_grow_with_its_reduce_scatter_steps() -> None:
    """The bounded ring re-selects the top k at each of its N - 1 reduce-scatter steps
    (the MNIST-1D CNN needed 1.0, 1.1, 1.7 and 2.9x fan-out's rounds at N = 2, 4, 8, 16):
    up to `RING_FREE_STEPS` of them as fan-out, then ``RING_STEP`` more for each. The
    exact ring sums exactly; a torus re-selects once per step of each of its rings."""
    def ring(n: int, **fields: object) -> float:
        return rounds_factor(job(agents=n, density=0.01, **fields), "ring")

    free = 1 + RING_FREE_STEPS  # the largest ring not charged: N = 4 (`docs/lab.md`)
    assert ring(2) == ring(free) == pytest.approx(ROUNDS_AT_FLOOR)
    assert ring(free + 1) == pytest.approx(ROUNDS_AT_FLOOR * (1 + RING_STEP))
    assert ring(8) == pytest.approx(ROUNDS_AT_FLOOR * (1 + 4 * RING_STEP))
    assert ring(4) < ring(8) < ring(16, topology="ring")
    assert ring(16, topology="ring") == pytest.approx(ROUNDS_AT_FLOOR * (1 + 12 * RING_STEP))
    assert ring(8, policy="exact") == pytest.approx(ROUNDS_AT_FLOOR)
    # N = 16 on topology "auto" is a 2 x 2 x 4 torus: 1 + 1 + 3 re-selections
    assert ring(16) == pytest.approx(ROUNDS_AT_FLOOR * (1 + 2 * RING_STEP))
    # the one-step collectives do not depend on N
    assert rounds_factor(job(agents=16, density=0.01), "fanout") == pytest.approx(ROUNDS_AT_FLOOR)


def test_collective_auto_alone_weighs_the_rings_extra_rounds() -> None:
    """Group-top-k on both plans, the collective chosen: at N = 8 fan-out reaches the
    target first where its all-reduce is up to 1.5x the ring's (the ring re-selects seven
    times); at N = 4 the ring's all-reduce alone decides."""
    spec = JobSpec.from_mapping({"agents": 8, "dataset": "mnist1d", "model": "cnn",
                                 "rounds": 200, "density": 0.01, "collective": "auto"})  # fmt: skip
    assert to_target(spec, "fanout", 0.075) < to_target(spec, "ring", 0.050)
    assert to_target(spec, "fanout", 0.080) > to_target(spec, "ring", 0.050)
    four = spec.replace(agents=4)
    assert to_target(four, "ring", 0.050) == to_target(four, "fanout", 0.050)


def test_a_round_the_cpu_bounds_goes_dense_where_the_link_alone_would_not() -> None:
    """50 Mbit/s, the CNN: group-top-k's all-reduce is shorter (8 ms against 14), so with
    no compute known it wins even at its extra rounds; with 5 ms of compute a round the
    extra rounds cost more than the link saves, and dense reaches the target first. On
    a 1 Mbit/s link group-top-k wins at any compute."""
    spec = job()
    bare = choose_plan(spec, NUMEL, probes(50.0))
    assert bare.algorithm == "ring"
    assert bare.predicted_s["ring"] < bare.predicted_s["dense ring"]
    computed = choose_plan(spec, NUMEL, probes(50.0), compute_s=0.005)
    assert computed.algorithm == "dense ring"
    assert computed.predicted_s == bare.predicted_s  # still all-reduce seconds
    assert choose_plan(spec, NUMEL, probes(1.0), compute_s=0.05).algorithm == "ring"


def test_simulate_chooses_the_collective_alone() -> None:
    """In process `compression = "auto"` runs group-top-k: no dense plan to pick."""
    choice = choose_collective(job(collective="auto"), NUMEL, probes(1000.0, rtt_s=0.0))
    assert set(choice.predicted_s) == {"ring", "fanout", "hub"}


def test_a_tie_goes_to_dense() -> None:
    """No link and no codec cost to see: dense, the plan with nothing to lose."""
    choice = choose_plan(job(collective="auto"), NUMEL, [Probe()] * 4)
    assert choice.algorithm == "dense ring"


class _Sum:
    """A one-member collective: the sum of a world of one is the vector itself."""

    world, timeout_s, one_step = 1, 1.0, False

    def allreduce_dense(self, vec: torch.Tensor, **_: object) -> torch.Tensor:
        return vec.clone()

    def allreduce_sparse(self, payload, **_: object):  # type: ignore[no-untyped-def]
        out = torch.zeros(payload.numel)
        payload.add_to(out)
        return out, torch.zeros(payload.numel)


def test_switching_to_dense_flushes_the_residual_and_loses_nothing() -> None:
    """What top-k held back goes out with the first dense round; after it the residual
    is empty, and every entry of every gradient has been delivered exactly once."""
    torch.manual_seed(0)
    r = Reducer(_Sum(), 512, ReducerSettings(density=0.05))  # type: ignore[arg-type]
    grads = [torch.randn(512) for _ in range(3)]
    sent = r.allreduce(grads[0], scale=1.0, round=0) + r.allreduce(grads[1], scale=1.0, round=1)
    held = r.ef.residual.clone()  # type: ignore[union-attr]
    assert held.norm() > 0
    r.dense = True
    flushed = r.allreduce(grads[2], scale=1.0, round=2)
    assert torch.allclose(flushed, grads[2] + held, atol=1e-6)
    assert r.residual_norm == 0.0
    assert torch.allclose(sent + flushed, sum(grads), atol=1e-5)  # type: ignore[arg-type]
    assert torch.equal(r.allreduce(grads[0], scale=1.0, round=3), grads[0])  # plain dense now
    r.dense = False  # back to group-top-k: error feedback starts from the empty residual
    r.allreduce(grads[1], scale=1.0, round=4)
    assert 0 < r.residual_norm < float(grads[1].norm())


@pytest.mark.parametrize(("kind", "value_dtype", "wire"), [
    ("fanout", "fp16", "fp16"), ("hub", "bf16", "bf16"), ("fanout", "int8", "fp16"),
    ("fanout", "fp32", "fp32"), ("ring", "fp16", "fp32"),
])  # fmt: skip
def test_a_dense_plan_sends_the_value_dtype_on_a_one_step_collective_only(
    kind: str, value_dtype: str, wire: str
) -> None:
    """Chosen dense (`Reducer.dense`), a fan-out or hub member sends every entry at the
    job's value dtype, as group-top-k sends its kept ones: half the bytes, and the same
    sum on every member; the ring's partial sums stay fp32. A job with no compression
    (its dense baseline) is fp32 everywhere; and the cost model charges the same bytes."""
    hub = InprocTransport()
    names = tuple(f"a{i}" for i in range(3))
    make = {"fanout": Fanout, "hub": Hub, "ring": Ring}[kind]
    settings = ReducerSettings(density=0.01, value_dtype=value_dtype)  # type: ignore[arg-type]
    reducers = [Reducer(make(PeerChannel(hub.connect(n), "job"), names, 10.0), 4096, settings)
                for n in names]  # fmt: skip
    plain = Reducer(reducers[1].collective, 4096, ReducerSettings())
    assert plain.dense_wire == "fp32" and reducers[1].dense_wire == "fp32"  # not chosen dense
    for r in reducers:
        r.dense = True
    assert reducers[1].dense_wire == wire
    grads = [torch.randn(4096) for _ in names]
    with ThreadPoolExecutor(3) as pool:
        sums = list(pool.map(lambda r, g: r.allreduce(g, scale=1.0, round=0), reducers, grads))
    assert all(torch.equal(s, sums[0]) for s in sums)
    torch.testing.assert_close(sums[0], sum(grads), atol=0.05, rtol=0.01)  # type: ignore[arg-type]
    sent = reducers[1].collective.channel.endpoint.stats.bytes_sent
    width = 4 if wire == "fp32" else 2
    assert (width * 4096 if kind != "ring" else 2 * 4 * 4096 * 2 / 3) <= sent, sent
    assert sent <= (width * 4096 + 256 if kind != "ring" else 4 * 4096 * 2), sent
    spec = JobSpec.from_mapping({"agents": 3, "value_dtype": value_dtype, "compression": "auto"})
    work = workload(spec, 4096)
    assert work.dense_wire_bytes == (4 if value_dtype == "fp32" else 2) * 4096 + HEADER_BYTES
    probes = [Probe(rtt_s=0.01, up_bps=1e6, down_bps=1e6)] * 3
    wide = predict(f"dense {kind}", probes, replace(work, dense_wire_bytes=0.0))
    assert (predict(f"dense {kind}", probes, work) < wide) == (wire != "fp32")


@pytest.mark.parametrize("topology", ["ring", "torus"])
def test_a_ring_refuses_to_sum_dense_vectors_at_half_width(topology: str) -> None:
    """Its partial sums would be rounded again at every step: `Reducer.dense_wire` never
    asks it to (`one_step` is false), and a caller that does is told so before any send."""
    hub = InprocTransport()
    names = tuple(f"a{i}" for i in range(4))
    channel = PeerChannel(hub.connect(names[0]), "job")
    ring = Ring(channel, names, 10.0)
    group = ring if topology == "ring" else Torus(channel, names, 10.0, dims=(2, 2))
    assert not group.one_step
    with pytest.raises(ValueError, match="in fp32, not fp16"):
        group.allreduce_dense(torch.ones(8), wire="fp16")
    assert channel.endpoint.stats.bytes_sent == 0
