"""The agent's job state: snapshots around checkpoints, and the head's checkpoint gate."""

from __future__ import annotations

import threading

import pytest
import torch

from fedring.build import plan
from fedring.collective import CollectiveError, CollectiveTimeout
from fedring.config import JobSpec
from fedring.edge_agent.daemon import _Running
from fedring.edge_agent.worker import KEEP_SNAPSHOTS, JobWorker, Segment
from fedring.engine.group import Group
from fedring.training.models import flat_sha256, set_flat_params
from fedring.transport.inproc import InprocTransport


def _worker(every: int) -> JobWorker:
    spec = JobSpec(agents=2, rounds=20, checkpoint_every=every)
    p = plan(spec)
    w = JobWorker("a0", "job-1", spec, 0, p.manifest.entry(0).to_dict(), p.model_sha256)
    solo = Group.on(InprocTransport().connect("a0"), ("a0",), job="job-1", key=None)
    w.bind(solo)  # the member whose states are kept
    return w


def test_the_three_newest_checkpoint_rounds_outlive_the_recent_snapshots() -> None:
    w = _worker(every=5)
    for r in range(1, 13):
        set_flat_params(w.model, w.params + 1.0)  # a different state every round
        w._keep(r)
    assert 10 in w.states and len(w.states) == KEEP_SNAPSHOTS
    assert set(w.states) == {0, 5, 10, 12}  # round 0 (`bind`) is a checkpoint round
    for r in range(13, 16):
        w._keep(r)
    # 15's upload and 10's may not be saved yet: a re-formed ring could restart at 5,
    # 10 or 15 (the head runs one checkpoint ahead of the last saved).
    assert set(w.states) == {5, 10, 14, 15}
    w._keep(16)
    assert set(w.states) == {5, 10, 15, 16}
    assert w.restore(5) and w.committed == 5
    assert not w.restore(12)


def test_a_kept_round_gives_its_own_parameters() -> None:
    w = _worker(every=1)
    seen = {}
    for r in range(1, 5):
        set_flat_params(w.model, w.params + 1.0)
        w._keep(r)
        seen[r] = w.params.clone()
    w.committed = 4
    assert all(torch.equal(w.params_at(r), seen[r]) for r in (2, 3, 4))  # type: ignore[arg-type]
    set_flat_params(w.model, w.params + 1.0)  # round 4 ran: the model is past it
    w.committed = 5
    assert torch.equal(w.params_at(5), w.params)  # type: ignore[arg-type]
    assert torch.equal(w.params_at(4), seen[4])  # type: ignore[arg-type]
    assert w.params_at(0) is None  # dropped long ago


def test_every_round_checkpoints_keep_only_the_recent_rounds() -> None:
    w = _worker(every=1)
    for r in range(1, 9):
        w._keep(r)
    assert set(w.states) == {5, 6, 7, 8}


def _segment() -> Segment:
    return Segment(job="job-1", epoch=0, members=["a0", "a1"], start_round=0,
                   params_sha256="", head="a0")  # fmt: skip


def test_the_head_runs_one_checkpoint_ahead_of_the_last_saved() -> None:
    run = _Running(_segment(), threading.Thread(), acked=5)
    run.gate(14, every=5, patience=0.05)  # round 5 is saved: 10's may be on its way
    with pytest.raises(CollectiveTimeout):
        run.gate(15, every=5, patience=0.05)  # 10's is not saved yet
    run.ack(10)
    run.gate(19, every=5, patience=0.05)
    run.gate(11, every=1, patience=0.05)  # every round: the one before last, 10
    with pytest.raises(CollectiveTimeout):
        run.gate(12, every=1, patience=0.05)
    with pytest.raises(CollectiveTimeout):  # before the bye: the last one itself
        run.gate(11, every=1, patience=0.05, ahead=0)


@pytest.mark.parametrize("where", ["head-halted", "head-timed-out", "member-halted"])
def test_a_round_stopped_before_it_began_is_kept_for_the_nack(where: str) -> None:
    """Halted (or timed out) in the head's checkpoint gate, or halted without one, an
    agent still holds the state at the start of that round, so its nack names a sha256
    and a re-plan resumes there (CI: the head, halted in its gate, kept none; its nack
    said round 34 with no sha256, and the ring went back to round 0)."""
    w = _worker(every=1000)
    for r in range(1, 34):
        set_flat_params(w.model, w.params + 1.0)
        w._keep(r)
    set_flat_params(w.model, w.params + 1.0)  # round 33 ran: 34's start is the model
    w.committed = 34
    run = _Running(_segment(), threading.Thread(), acked=0 if where == "head-timed-out" else 34)
    if where != "head-timed-out":
        run.halt.set()  # the coordinator's halt arrived before round 34
    head = where.startswith("head")
    gate = (lambda r: run.gate(r, every=1, patience=0.05)) if head else None
    with pytest.raises(CollectiveError):
        w.start_round(34, run.halt, gate)
    assert w.state_sha256(34) == flat_sha256(w.params)


def test_the_ring_frame_size_from_the_manifest_is_used() -> None:
    """A board that takes at most 8 KiB frames gets a dense 69 KB model in parts."""
    from fedring.counters import Counters

    spec = JobSpec(agents=2, rounds=2, compression="none", eval_every=2)
    p = plan(spec)
    hub = InprocTransport()
    workers = [JobWorker(f"a{i}", "job-1", spec, i, p.manifest.entry(i).to_dict(), p.model_sha256)
               for i in range(2)]  # fmt: skip
    ends = [hub.connect(w.me) for w in workers]
    results: list[dict] = [{}, {}]

    def run(i: int) -> None:
        seg = Segment(job="job-1", epoch=0, members=["a0", "a1"], start_round=0,
                      params_sha256="", head="a0", max_frame_bytes=8192)  # fmt: skip
        results[i] = workers[i].run(seg, ends[i], b"k" * 32, Counters(), threading.Event(),
                                    lambda r, row: None)  # fmt: skip

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results[0]["sha256"] == results[1]["sha256"] and results[0]["rounds"] == 2
    # 2 rounds x 2 ring steps, each half of 69 KB in 8 KiB frames: > 4 frames each.
    assert all(e.stats.frames_sent >= 2 * 2 * 4 for e in ends)
    assert all(e.stats.bytes_sent / e.stats.frames_sent <= 8192 for e in ends)


def test_a_head_asked_for_its_whole_model_sends_it_and_still_waits_for_the_ack() -> None:
    run = _Running(_segment(), threading.Thread(), acked=4)
    sent: list[int] = []

    def upload(r: int) -> None:
        sent.append(r)
        run.ack(r)  # the coordinator saves it and acks

    run.want(5)
    run.gate(5, every=1, patience=1.0, upload=upload)
    assert sent == [5] and run.acked == 5
    run.want(3)  # a round already saved: not sent
    run.gate(6, every=1, patience=0.05, upload=upload)
    assert sent == [5]
    with pytest.raises(CollectiveTimeout):
        run.gate(7, every=1, patience=0.05, upload=upload)
    assert sent == [5]


def test_a_want_for_an_earlier_round_is_served_at_the_next_gate() -> None:
    """A round's patches refused while the head ran on: it uploads that round's state
    at its next gate even where the gate would not wait, and the newest ask wins."""
    run = _Running(_segment(), threading.Thread(), acked=4)
    sent: list[int] = []
    run.want(5)
    run.want(6)  # 6's patches refused too: its save acks 5 as well
    run.gate(6, every=1, patience=1.0, upload=lambda r: (sent.append(r), run.ack(r)))
    assert sent == [6] and run.acked == 6


@pytest.mark.parametrize("manifest_timeout_s", [0.0, 30.0])
def test_a_segment_waits_each_step_as_long_as_its_manifest_says(manifest_timeout_s: float) -> None:
    """A member 2 s late: past the job's 0.5 s step deadline, within the 30 s the
    coordinator put in the manifest for a plan whose steps outlast the job's."""
    from fedring.counters import Counters

    spec = JobSpec(agents=2, rounds=2, compression="none", eval_every=2, timeout_s=0.5)
    p = plan(spec)
    hub = InprocTransport()
    workers = [JobWorker(f"a{i}", "job-1", spec, i, p.manifest.entry(i).to_dict(), p.model_sha256)
               for i in range(2)]  # fmt: skip
    ends = [hub.connect(w.me) for w in workers]
    results: list[dict | BaseException] = [{}, {}]

    def run(i: int) -> None:
        seg = Segment(job="job-1", epoch=0, members=["a0", "a1"], start_round=0,
                      params_sha256="", head="a0", timeout_s=manifest_timeout_s)  # fmt: skip
        if i == 1:
            threading.Event().wait(2.0)
        try:
            results[i] = workers[i].run(seg, ends[i], b"k" * 32, Counters(), threading.Event(),
                                        lambda r, row: None)  # fmt: skip
        except CollectiveTimeout as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if manifest_timeout_s:
        assert isinstance(results[0], dict) and isinstance(results[1], dict)
        assert results[0]["sha256"] == results[1]["sha256"] and results[0]["rounds"] == 2
    else:
        assert isinstance(results[0], CollectiveTimeout)  # the job's own deadline
