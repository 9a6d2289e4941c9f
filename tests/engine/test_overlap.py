"""Overlap in sync mode: bucket layout, per-bucket compression, agreement, failures."""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fedring import build
from fedring.collective.channel import CollectiveError, CollectiveTimeout, PeerChannel, PeerLost
from fedring.collective.ring import Ring
from fedring.compression.error_feedback import ErrorFeedback
from fedring.compression.group_topk import GroupTopK
from fedring.config import JobSpec, SpecError
from fedring.engine.buckets import Readiness, bucket_layout
from fedring.engine.loop import Member, train_step
from fedring.engine.optimizer import SyncSettings
from fedring.engine.overlap import BucketOverlap, CommThread
from fedring.engine.reducer import Reducer
from fedring.sim.runner import prepare_model, simulate
from fedring.training.models import flat_grads
from fedring.transport.base import Deadline
from fedring.transport.inproc import InprocTransport
from tests.engine.refusals import assert_refused

TIMES = ("compute_s", "comm_s", "step_s")
SMALL = {"agents": 3, "rounds": 20, "eval_every": 20}
SLOW_S = 0.05


def _comm_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if "-comm-" in t.name]


# -- layout --------------------------------------------------------------------


@given(
    sizes=st.lists(st.integers(0, 700), min_size=1, max_size=12).filter(lambda s: sum(s) > 0),
    bucket=st.integers(1, 2000),
    group=st.sampled_from([1, 4, 64, 256]),
)
def test_buckets_cover_the_vector_once_in_backward_order_on_group_boundaries(
    sizes: list[int], bucket: int, group: int
) -> None:
    buckets = bucket_layout(sizes, bucket, group)
    numel = sum(sizes)
    assert buckets[0].end == numel and buckets[-1].start == 0
    for later, earlier in itertools.pairwise(buckets):
        assert earlier.end == later.start  # contiguous, descending: backward order
    assert len(buckets) == 1 or 2 * buckets[-1].numel >= bucket  # no tiny last ring
    for b in buckets:
        assert b.numel > 0 and b.start % group == 0
        assert b.end == numel or b.end % group == 0
        offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        touching = [i for i in range(len(sizes)) if offsets[i] < b.end and offsets[i + 1] > b.start]
        assert list(b.params) == touching


def test_mlp_layers_split_where_the_sizes_say() -> None:
    # digits mlp: 64x128 + 128, 128x64 + 64, 64x10 + 10 = 17226 entries
    sizes = [8192, 128, 8192, 64, 640, 10]
    layout = [(b.start, b.end, b.params) for b in bucket_layout(sizes, 4096, 256)]
    # the last two layers fill a bucket at W2's start, 8320, rounded up to 8448
    assert layout == [(8448, 17226, (2, 3, 4, 5)), (0, 8448, (0, 1, 2))]
    assert len(bucket_layout(sizes, 10**6, 256)) == 1


def test_readiness_hands_buckets_over_in_order_only() -> None:
    buckets = bucket_layout([10, 10, 10], 10, 1)  # one bucket per parameter, 2 first
    ready = Readiness(buckets)
    assert ready.arrived(1) == []  # bucket 1 is complete, but bucket 0 has not gone
    assert ready.arrived(2) == [0, 1]
    assert ready.rest() == [2]  # parameter 0 never got a gradient
    assert ready.rest() == []


@given(x=st.integers(0, 2**31 - 1), group=st.sampled_from([4, 16, 256]), k=st.integers(1, 4))
def test_group_topk_per_bucket_keeps_what_it_keeps_over_the_whole_vector(
    x: int, group: int, k: int
) -> None:
    sizes = [700, 30, 500, 9, 120]
    vec = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(x))
    topk = GroupTopK(group, k)
    whole = topk.compress(vec).decompress()
    parts = torch.zeros_like(vec)
    for b in bucket_layout(sizes, 300, group):
        parts[b.start : b.end] = topk.compress(vec[b.start : b.end]).decompress()
    assert torch.equal(parts, whole)


def test_error_feedback_part_works_on_the_whole_residual() -> None:
    ef = ErrorFeedback(8, momentum=0.5)
    part = ef.part(4, 8)
    g = part.compensate(torch.ones(4))
    part.update(GroupTopK(4, 1).compress(g))
    assert ef.residual[:4].tolist() == [0.0] * 4
    assert sorted(ef.residual[4:].tolist()) == [0.0, 1.0, 1.0, 1.0]
    assert ef.velocity is not None and float(ef.velocity[4:].sum()) == 3.0
    with pytest.raises(ValueError, match="part"):
        ef.part(4, 9)


# -- training ------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes",
    [{}, {"compression": "none"}, {"aggregation": "weighted", "sharding": "quantity:1.0"}],
    ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()) or "group-topk",
)
def test_agents_with_buckets_end_identical_and_rows_carry_the_times(
    changes: dict[str, Any],
) -> None:
    plain = simulate(JobSpec(**SMALL, **changes))
    bucketed = simulate(JobSpec(**SMALL, **changes, bucket_kb=4))
    assert bucketed["identical_models"]
    assert bucketed["model_hashes"] != plain["model_hashes"]  # the buckets did run
    assert bucketed["frames_sent_per_agent"] > plain["frames_sent_per_agent"]
    for s in (plain, bucketed):
        for row in s["rows"]:
            assert all(row[k] > 0 for k in TIMES)
            assert row["step_s"] >= row["compute_s"]
        assert set(s["round_seconds"]) == set(TIMES)


def test_buckets_on_a_torus_agree() -> None:
    s = simulate(JobSpec(agents=4, topology="torus", rounds=10, eval_every=10, bucket_kb=4))
    assert s["layout"] == "torus 2x2" and s["identical_models"]


def test_accuracy_with_buckets_is_that_without() -> None:
    base = {"agents": 3, "rounds": 200, "eval_every": 100}
    plain = simulate(JobSpec(**base))["final_accuracy"]
    bucketed = simulate(JobSpec(**base, bucket_kb=4))["final_accuracy"]
    assert plain > 0.9
    assert abs(bucketed - plain) <= 0.015, (plain, bucketed)


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward takes `SLOW_S`: a layer with a costly backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(SLOW_S)
        return grad


class _Slow(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SlowBackward.apply(x)  # type: ignore[no-any-return]


def _solo_member(model: torch.nn.Module, **changes: Any) -> Member:
    """A one-member ring over an in-process channel, training `model` on a small shard."""
    spec = JobSpec(agents=1, dataset="synthetic:200:64:10", batch_size=16, **changes)
    task = build.task_of(spec)
    data = task.dataset(spec.seed)
    ring = Ring(PeerChannel(InprocTransport().connect("solo"), "t"), ("solo",))
    return build.member(spec, task, data, model, data.x_train[:64], data.y_train[:64], ring,
                        rank=0, weight=1.0)  # fmt: skip


def test_buckets_travel_while_backward_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    # Backward: L4, (slow) L3, (slow) L2, (slow) L1; each bucket's ring also takes
    # SLOW_S. In sequence that is 3 + 4 units; overlapped, about 4.
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 64) for _ in range(3)] + [torch.nn.Linear(64, 10)]
    model = torch.nn.Sequential(
        layers[0], _Slow(), layers[1], _Slow(), layers[2], _Slow(), layers[3]
    )
    member = _solo_member(model, bucket_kb=1, group_size=64)
    opt = member.state.optimizer
    overlap = opt.overlap
    assert overlap is not None and len(overlap.buckets) == 4  # one per layer

    def slow_ring(vec: torch.Tensor, *, scale: float, **_: Any) -> torch.Tensor:
        time.sleep(SLOW_S)
        return vec * scale

    local: list[torch.Tensor] = []
    agreed: list[torch.Tensor] = []
    collect = overlap.collect

    def recording_collect() -> tuple[torch.Tensor, float]:
        local.append(flat_grads(opt.params))  # the .grad of this member, before the step
        total, comm_s = collect()
        agreed.append(total)
        return total, comm_s

    monkeypatch.setattr(overlap.reducer, "allreduce_bucket", slow_ring)
    monkeypatch.setattr(overlap, "collect", recording_collect)
    train_step(member)  # warm-up: the first backward sets up
    start = time.perf_counter()
    _, compute_s = train_step(member)
    took = time.perf_counter() - start
    comm_s = opt.times.comm_s
    assert torch.equal(agreed[-1], local[-1])  # every bucket came back in its place
    assert opt.round == 2 and _comm_threads() == []
    assert compute_s >= 3 * SLOW_S and comm_s >= 4 * SLOW_S
    assert took < 0.8 * (compute_s + comm_s), (took, compute_s, comm_s)
    assert took <= 1.25 * max(compute_s, comm_s), (took, compute_s, comm_s)


def test_every_bucket_is_tagged_with_its_own_round(monkeypatch: pytest.MonkeyPatch) -> None:
    # Bucket 0 is reduced while the slow backward still runs, before `step`: its
    # frames must still carry this round (and its DGC warm-up k be this round's).
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), _Slow(), torch.nn.Linear(64, 10))
    member = _solo_member(model, bucket_kb=1, group_size=64)
    opt = member.state.optimizer
    assert opt.overlap is not None and len(opt.overlap.buckets) == 2
    tags: list[tuple[int, int]] = []
    allreduce_bucket = Reducer.allreduce_bucket

    def recording(self: Reducer, vec: torch.Tensor, **kw: Any) -> torch.Tensor:
        tags.append((kw["round"], kw["bucket"]))
        return allreduce_bucket(self, vec, **kw)

    monkeypatch.setattr(Reducer, "allreduce_bucket", recording)
    opt.round = 5  # as `engine.loop.run` resumes a member
    for _ in range(3):
        train_step(member)
    assert tags == [(r, j) for r in (5, 6, 7) for j in (0, 1)], tags


def test_bucket_kb_zero_takes_the_old_path(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("bucket path taken with bucket_kb=0")

    default = simulate(JobSpec(**SMALL))["model_hashes"]
    monkeypatch.setattr(BucketOverlap, "__init__", refuse)
    monkeypatch.setattr(Reducer, "allreduce_bucket", refuse)
    assert simulate(JobSpec(**SMALL, bucket_kb=0))["model_hashes"] == default


# -- failures ------------------------------------------------------------------


def _lonely_agent(peer_connects: bool) -> Member:
    """Agent 0 of a two-agent ring whose agent 1 is silent or never connected."""
    spec = JobSpec(agents=2, dataset="synthetic:200:8:3", timeout_s=0.3, bucket_kb=1)
    p = build.plan(spec)
    model, x, y = prepare_model(spec, p, 0)
    hub = InprocTransport()
    channel = PeerChannel(hub.connect("agent-0"), "t")
    if peer_connects:
        hub.connect("agent-1")  # connected, never answers
    ring = Ring(channel, ("agent-0", "agent-1"), spec.timeout_s)
    member = build.member(spec, p.task, p.dataset, model, x, y, ring, rank=0,
                          weight=p.weights[0])  # fmt: skip
    overlap = member.state.optimizer.overlap
    assert overlap is not None and len(overlap.buckets) > 1
    return member


@pytest.mark.parametrize(("peer_connects", "error"), [(True, CollectiveTimeout), (False, PeerLost)])
def test_a_ring_failure_reaches_the_main_thread_as_itself(
    peer_connects: bool, error: type[CollectiveError]
) -> None:
    member = _lonely_agent(peer_connects)
    opt = member.state.optimizer
    reducer = opt.reducer
    with pytest.raises(error):  # the same error without buckets
        reducer.allreduce(torch.ones(reducer.numel), scale=0.5, round=0)
    opt.round = 1
    try:
        with pytest.raises(error):
            train_step(member)
        assert _comm_threads() == []
    finally:
        opt.close()


def test_a_failing_bucket_in_the_simulator_ends_the_run_and_its_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    allreduce_bucket = Reducer.allreduce_bucket

    def flaky(self: Reducer, vec: torch.Tensor, **kw: Any) -> torch.Tensor:
        if self.channel.name == "agent-1" and kw["round"] == 3 and kw["bucket"] == 1:
            raise RuntimeError("agent-1 broke in bucket 1")
        return allreduce_bucket(self, vec, **kw)

    monkeypatch.setattr(Reducer, "allreduce_bucket", flaky)
    with pytest.raises(RuntimeError, match="agent-1 broke"):  # the cause, not the neighbours'
        simulate(JobSpec(**SMALL, bucket_kb=4, timeout_s=5.0))
    assert _comm_threads() == []


def test_comm_thread_errors_skip_the_rest_and_end_the_thread() -> None:
    done: list[int] = []
    boom = ValueError("bucket 1 failed")

    def reduce(j: int, vec: torch.Tensor) -> torch.Tensor:
        if j == 1:
            raise boom
        done.append(j)
        return vec

    comm = CommThread(reduce, "test-comm-r0")
    for j in range(4):
        comm.hand(j, torch.zeros(1))
    with pytest.raises(ValueError) as caught:
        comm.finish(Deadline.after(5.0))
    assert caught.value is boom and done == [0]
    assert _comm_threads() == []


def test_abandoned_comm_thread_ends() -> None:
    comm = CommThread(lambda _, v: v, "test-comm-r1")
    comm.abandon()
    comm._thread.join(5.0)
    assert _comm_threads() == []


# -- validation ----------------------------------------------------------------


@pytest.mark.parametrize(
    "changes",
    [
        {"sync": "local"},
        {"sync": "async"},
        {"aggregation": "vote"},
        {"aggregation": "hybrid:0.9"},
        {"aggregation": "median", "topology": "star"},
        {"topology": "star"},
    ],
    ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()),
)
def test_buckets_outside_sync_mean_on_a_ring_are_refused(changes: dict[str, object]) -> None:
    with pytest.raises(SpecError, match="field 'bucket_kb'=8"):
        JobSpec(bucket_kb=8, **changes)  # type: ignore[arg-type]
    JobSpec(bucket_kb=0, **changes)  # type: ignore[arg-type]  # off: accepted anywhere


@pytest.mark.parametrize("value", [-1, 10**7])
def test_bucket_kb_out_of_range_is_refused(value: int) -> None:
    with pytest.raises(SpecError, match=f"field 'bucket_kb'={value}"):
        JobSpec.from_mapping({"bucket_kb": value})


def test_bucket_kb_comes_from_a_job_file() -> None:
    assert JobSpec.from_mapping({"bucket_kb": 64, "aggregation": "weighted"}).bucket_kb == 64
    with pytest.raises(SpecError, match=r"field 'bucket_kb'=1\.5 must be int"):
        JobSpec.from_mapping({"bucket_kb": 1.5})


@pytest.mark.parametrize("aggregation", ["vote", "hybrid:0.9", "median"])
def test_the_optimizer_refuses_buckets_outside_mean_or_weighted(aggregation: str) -> None:
    assert_refused(SyncSettings(bucket_kb=8, aggregation=aggregation),
                   "overlap needs aggregation mean or weighted")  # fmt: skip
