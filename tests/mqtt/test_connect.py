"""`fedring.connect` against a real Mosquitto: rendezvous, all-reduce, and every refusal."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

import fedring
from fedring.rendezvous import (
    DuplicateAgent,
    MqttGroup,
    RendezvousTimeout,
    TooManyAgents,
    online_status,
)
from fedring.transport.base import Deadline
from fedring.transport.mosquitto import Mosquitto, free_port
from fedring.transport.mqtt import BrokerConfig, BrokerUnreachable
from tests.mqtt.conftest import MISSING

pytestmark = pytest.mark.skipif(bool(MISSING), reason=MISSING or "mosquitto present")

KEY = b"shared secret"
ACL = Path(__file__).resolve().parents[2] / "examples" / "mosquitto.acl"


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with Mosquitto(workdir=tmp_path_factory.mktemp("connect")) as b:
        yield b.url


def on_threads(fns: dict[str, Callable[[], Any]], timeout: float = 30.0) -> dict[str, Any]:
    """Run each function on its own thread: name -> what it returned or raised."""
    out: dict[str, Any] = {}

    def run(name: str, fn: Callable[[], Any]) -> None:
        try:
            out[name] = fn()
        except BaseException as exc:  # handed back to the test
            out[name] = exc

    threads = [threading.Thread(target=run, args=item, daemon=True) for item in fns.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert set(out) == set(fns), f"still running: {set(fns) - set(out)}"
    return out


def on_threads_later(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Start `fn` on a thread now; the returned call waits for its result (or exception)."""
    box: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.update(on_threads({"fn": fn})), daemon=True)
    thread.start()

    def result() -> Any:
        thread.join(30)
        return box["fn"]

    return result


def join(url: str, job: str, agent_id: str, world: int, **options: Any) -> MqttGroup:
    return fedring.connect(url, job=job, agent_id=agent_id, world=world, key=KEY,
                           **{"wait_s": 10.0, **options})  # fmt: skip


def reduce_both(group: fedring.Group, vec: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean of the group's vectors, dense (round 0), then group-top-k 10% (round 1)."""
    settings = [fedring.ReducerSettings(compression="none"),
                fedring.ReducerSettings(compression="group-topk", density=0.1)]  # fmt: skip
    dense, topk = (fedring.Reducer(group.collective, vec.numel(), s) for s in settings)
    scale = 1.0 / group.world
    return dense.allreduce(vec, scale=scale, round=0), topk.allreduce(vec, scale=scale, round=1)


def test_four_agents_meet_and_reduce_as_the_local_group_does(url: str) -> None:
    vecs = [torch.randn(1000, generator=torch.Generator().manual_seed(i)) for i in range(4)]

    def agent(name: str) -> tuple[int, tuple[str, ...], str, tuple[torch.Tensor, torch.Tensor]]:
        with fedring.connect(url, job="sum", agent_id=name, world=4, key=KEY, timeout_s=10.0,
                             wait_s=15.0) as group:  # fmt: skip
            assert isinstance(group, fedring.Group)
            return group.rank, group.members, group.layout, reduce_both(group, vecs[group.rank])

    names = ["pi-3", "pi-1", "pi-0", "pi-2"]  # started out of rank order
    got = on_threads({n: partial(agent, n) for n in names})
    groups = fedring.local_group(4)
    local = on_threads({str(r): partial(reduce_both, groups[r], vecs[r]) for r in range(4)})
    mean = torch.stack(vecs).mean(0)
    for name in names:
        assert not isinstance(got[name], BaseException), got[name]
        rank, members, layout, (dense, topk) = got[name]
        assert members == ("pi-0", "pi-1", "pi-2", "pi-3") and rank == int(name[-1])
        assert layout == "ring of 4"
        assert torch.allclose(dense, mean, atol=1e-6)
        assert torch.equal(dense, local[str(rank)][0])  # the same ring, bit for bit
        assert torch.equal(topk, local[str(rank)][1])
        assert torch.equal(topk, got["pi-0"][3][1])


def test_a_short_rendezvous_names_who_came_and_how_many_are_missing(url: str) -> None:
    start = time.monotonic()
    got = on_threads({
        "t-a": partial(join, url, "short", "t-a", 3, wait_s=1.5),
        "t-b": partial(join, url, "short", "t-b", 3, wait_s=2.5),  # outlasts t-a
    })  # fmt: skip
    took = time.monotonic() - start
    a, b = got["t-a"], got["t-b"]
    assert isinstance(a, RendezvousTimeout) and isinstance(a, TimeoutError)
    assert a.missing == 1 and a.present == ("t-a", "t-b") and a.job == "short"
    assert "'short': 2 of 3 agents after 1.5 s, 1 missing (present: t-a, t-b)" in str(a)
    assert isinstance(b, RendezvousTimeout)  # t-a left when it gave up: it counts no more
    assert b.missing == 2 and b.present == ("t-b",) and 2.5 <= b.waited_s < 3.5
    assert 2.5 <= took < 4.0
    # A refused agent left the broker: its id is free again.
    with fedring.connect(url, job="alone", agent_id="t-a", world=1, key=KEY, wait_s=5) as g:
        assert g.members == ("t-a",) and g.rank == 0


def test_two_jobs_on_one_broker_form_their_own_groups(url: str) -> None:
    jobs = {"x-1": "x", "x-2": "x", "y-1": "y", "y-2": "y"}
    got = on_threads({n: partial(join, url, jobs[n], n, 2) for n in jobs})
    for name, group in got.items():
        assert isinstance(group, MqttGroup), group
        group.close()
        assert group.members == tuple(n for n in sorted(jobs) if jobs[n] == jobs[name])


def test_frames_queued_from_an_earlier_run_of_the_job_are_refused(url: str) -> None:
    """s-1 crashes (no goodbye), so the broker keeps its session: what s-2 sent while s-1
    was away arrives when s-1 is back. Those frames carry the old run's tag, so the new
    run refuses them. (A clean goodbye clears the session: test_security.py.)"""

    def run(vec: dict[str, torch.Tensor], replay: bool) -> dict[str, Any]:
        groups = on_threads({n: partial(join, url, "again", n, 2) for n in vec})
        sent: list[tuple[str, str, bytes, Deadline]] = []
        link = groups["s-2"].link
        send_to = link.send_to

        def recording(job: str, dst: str, data: bytes, deadline: Deadline) -> None:
            sent.append((job, dst, data, deadline))
            send_to(job, dst, data, deadline)

        link.send_to = recording
        sums = on_threads({n: partial(groups[n].collective.allreduce_dense, vec[n]) for n in vec})
        groups["s-1"].link.kill()
        if replay:  # as if s-2 had sent them after s-1 went away: the broker queues them
            for job, dst, data, _ in sent:
                send_to(job, dst, data, Deadline.after(5))
        sums["refused"] = groups["s-1"].link.counters.snapshot().get("frame_unexpected", 0)
        groups["s-2"].close()
        return sums

    first = run({"s-1": torch.full((8,), 100.0), "s-2": torch.full((8,), 200.0)}, replay=True)
    assert torch.equal(first["s-1"], torch.full((8,), 300.0)) and first["refused"] == 0
    second = run({"s-1": torch.ones(8), "s-2": torch.full((8,), 2.0)}, replay=False)
    assert second["refused"] >= 1  # the old run's frames did come back, and were refused
    assert torch.equal(second["s-1"], torch.full((8,), 3.0))
    assert torch.equal(second["s-2"], torch.full((8,), 3.0))


def test_an_id_online_elsewhere_is_refused_without_disturbing_its_holder(url: str) -> None:
    holder = on_threads_later(partial(join, url, "dup", "d-1", 2))
    deadline = time.monotonic() + 10
    while online_status(BrokerConfig.parse(url), "d-1") is None:
        assert time.monotonic() < deadline, "the holder never came online"
        time.sleep(0.05)
    start = time.monotonic()
    with pytest.raises(DuplicateAgent, match=r"'d-1' is already online at mqtt://.* in job 'dup'"):
        fedring.connect(url, job="other", agent_id="d-1", world=2, key=KEY, wait_s=10)
    assert time.monotonic() - start < 3.0
    with fedring.connect(url, job="dup", agent_id="d-2", world=2, key=KEY, wait_s=10) as mate:
        first = holder()
        assert isinstance(first, MqttGroup), first
        with first:
            assert first.members == mate.members == ("d-1", "d-2")
            sums = on_threads({
                "d-1": partial(first.collective.allreduce_dense, torch.ones(10)),
                "d-2": partial(mate.collective.allreduce_dense, torch.full((10,), 2.0)),
            })  # fmt: skip
            assert torch.equal(sums["d-1"], torch.full((10,), 3.0))
            assert torch.equal(sums["d-2"], sums["d-1"])
    assert online_status(BrokerConfig.parse(url), "d-1") is None  # closed: the id is free


def test_an_agent_beyond_the_world_is_refused(url: str) -> None:
    pair = on_threads({n: partial(join, url, "full", n, 2) for n in ("f-1", "f-2")})
    try:
        with pytest.raises(TooManyAgents, match="3 agents online for a world of 2: f-1, f-2, f-3"):
            fedring.connect(url, job="full", agent_id="f-3", world=2, key=KEY, wait_s=10)
    finally:
        for group in pair.values():
            group.close()


def test_the_example_acl_lets_agents_meet_as_they_are(tmp_path: Path) -> None:
    users = {"a1": "pw-1", "a2": "pw-2"}
    with Mosquitto(users=users, acl=ACL, workdir=tmp_path) as b:
        got = on_threads({
            n: partial(join, b.url, "acl", n, 2, username=n, password=users[n]) for n in users
        })  # fmt: skip
        sums = on_threads({n: partial(got[n].collective.allreduce_dense, torch.ones(4))
                           for n in users})  # fmt: skip
        for group in got.values():
            group.close()
    assert all(torch.equal(s, torch.full((4,), 2.0)) for s in sums.values())


def test_a_dead_broker_is_unreachable_at_once() -> None:
    start = time.monotonic()
    with pytest.raises(BrokerUnreachable, match="Connection refused"):
        join(f"mqtt://127.0.0.1:{free_port()}", "j", "x", 2, wait_s=60.0)
    assert time.monotonic() - start < 2.0  # refused: no waiting out wait_s


@pytest.mark.parametrize("collective", ["fanout", "hub"])
def test_one_step_collectives_reduce_as_the_local_group_does(url: str, collective: str) -> None:
    vecs = [torch.randn(1000, generator=torch.Generator().manual_seed(i)) for i in range(3)]

    def agent(name: str) -> tuple[int, str, tuple[torch.Tensor, torch.Tensor]]:
        with join(url, f"one-{collective}", name, 3, collective=collective,
                  timeout_s=10.0) as group:  # fmt: skip
            return group.rank, group.layout, reduce_both(group, vecs[group.rank])

    got = on_threads({n: partial(agent, n) for n in ("b-0", "b-1", "b-2")})
    groups = fedring.local_group(3, algorithm=collective)
    local = on_threads({str(r): partial(reduce_both, groups[r], vecs[r]) for r in range(3)})
    for name, result in got.items():
        assert not isinstance(result, BaseException), result
        rank, layout, (dense, topk) = result
        assert layout == f"{collective} of 3"
        assert torch.allclose(dense, torch.stack(vecs).mean(0), atol=1e-6)
        assert torch.equal(topk, local[str(rank)][1]), name  # the same sum, bit for bit


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("world", 0, "world must be a whole number >= 1"),
        ("collective", "auto", "collective 'auto' must be one of ring, fanout, hub"),
        ("key", b"", "key must be non-empty bytes"),
        ("topology", "star", "topology 'star' must be one of auto, ring, torus"),
        ("agent_id", "coordinator", "reserved for the coordinator"),
        ("job", "a/b", "job 'a/b' must be 1-64 characters"),
        ("wait_s", 0.0, "wait_s must be > 0"),
    ],
)
def test_bad_arguments_are_refused_before_the_network(field: str, value: Any, message: str) -> None:
    args: dict[str, Any] = {"job": "j", "agent_id": "x", "world": 2, "key": KEY}
    with pytest.raises(ValueError, match=message):
        fedring.connect("mqtt://127.0.0.1:9", **{**args, field: value})
