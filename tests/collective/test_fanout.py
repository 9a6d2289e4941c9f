"""Fan-out and hub reduce over real frames: every member gets the same bits, equal to
the dense sum of the members' compressed payloads; one broadcast costs the sender once."""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedring.collective import PeerChannel, PeerLost
from fedring.collective.fanout import Fanout, Hub
from fedring.collective.payloads import encode_payload
from fedring.compression import GroupSparse, GroupTopK
from fedring.compression.sparse import n_groups
from fedring.config import JobSpec, SpecError
from fedring.transport.base import Deadline, Delivery
from fedring.transport.inproc import InprocTransport
from fedring.wire.compact import decode_compact, encode_compact, header_bytes
from fedring.wire.errors import FrameError, FrameReason
from fedring.wire.frame import Frame
from tests.collective.mid_round import kill_c_mid_round
from tests.strategies import flat_vectors

KINDS = {"fanout": Fanout, "hub": Hub}


def _run(kind: str, world: int, fn: Callable[[Any], Any]) -> tuple[list[Any], list[Any]]:
    """``fn(collective)`` on every member, on threads; (results, endpoint stats)."""
    hub = InprocTransport()
    names = tuple(f"agent-{i}" for i in range(world))
    cols = [KINDS[kind](PeerChannel(hub.connect(n), "job", key=b"k"), names, 10.0) for n in names]
    with ThreadPoolExecutor(max_workers=world) as pool:
        results = list(pool.map(fn, cols))
    return results, [c.channel.endpoint.stats for c in cols]


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(list(KINDS)), world=st.integers(1, 5),
       g=st.sampled_from([1, 3, 64, 256]), data=st.data())  # fmt: skip
def test_every_member_gets_the_dense_sum_of_the_compressed_payloads(
    kind: str, world: int, g: int, data: st.DataObject
) -> None:
    first = data.draw(flat_vectors(max_numel=2000))
    xs = [first] + [torch.randn(first.numel()) for _ in range(world - 1)]
    topk = GroupTopK(g, data.draw(st.integers(1, min(g, 5))), "fp16")
    sparse = [topk.compress(x) for x in xs]
    ref = torch.zeros(first.numel())
    for s in sparse:  # dense fp32 additions in rank order: the bits the members must get
        ref = ref + s.decompress()
    results, _ = _run(kind, world, lambda c: c.allreduce_sparse(sparse[c.rank], round=3))
    for total, kept in results:
        assert torch.equal(total, ref)
        assert not bool(kept.any())  # nothing re-selected: error feedback keeps only its own


@pytest.mark.parametrize("kind", list(KINDS))
def test_dense_sum_is_the_same_bits_everywhere(kind: str) -> None:
    xs = [torch.randn(1000) for _ in range(4)]
    results, _ = _run(kind, 4, lambda c: c.allreduce_dense(xs[c.rank], bucket=1))
    assert all(torch.equal(r, results[0]) for r in results)
    torch.testing.assert_close(results[0], xs[0] + xs[1] + xs[2] + xs[3])


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("wire", ["fp16", "bf16"])
def test_a_half_width_dense_sum_is_the_same_bits_everywhere_at_half_the_bytes(
    kind: str, wire: str
) -> None:
    """A dense plan under ``compression = "auto"`` (`Reducer.dense_wire`): each member's
    vector goes rounded to `wire`, and every member adds the same rounded vectors in
    rank order into fp32 (the hub sends that fp32 sum down)."""
    xs = [torch.randn(1000) * 10.0 ** (i - 2) for i in range(4)]
    xs[3][:10] = 7e4  # beyond fp16's range: clamped, not inf
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[wire]
    ref = torch.zeros(1000)
    for x in xs:
        ref += x.clamp(-65504, 65504).to(dtype).float() if wire == "fp16" else x.to(dtype).float()
    results, stats = _run(kind, 4, lambda c: c.allreduce_dense(xs[c.rank], bucket=1, wire=wire))
    assert all(torch.equal(r, ref) for r in results) and bool(ref.isfinite().all())
    _, fp32 = _run(kind, 4, lambda c: c.allreduce_dense(xs[c.rank], bucket=1))
    up = stats[1].bytes_sent, fp32[1].bytes_sent  # a member's (the hub's own is the sum)
    assert 2000 <= up[0] <= 2000 + 128 and 4000 <= up[1] <= 4000 + 128, up


def test_a_broadcast_costs_the_senders_uplink_once_and_each_downlink_once() -> None:
    hub = InprocTransport()
    a, b, c = (hub.connect(n) for n in "abc")
    a.broadcast(b"x" * 100, Deadline.after(1))
    for other in (b, c):
        got = other.recv(Deadline.after(1))
        while not isinstance(got, Delivery):  # membership events first
            got = other.recv(Deadline.after(1))
        assert got == Delivery("a", b"x" * 100)
        assert other.stats.bytes_received == 100 and other.stats.frames_received == 1
    assert a.stats.bytes_sent == 100 and a.stats.frames_sent == 1
    assert a.stats.per_peer_sent == {"*": 100}
    assert a.stats.bytes_received == 0  # no echo


def test_fanout_sends_one_payload_a_round_and_receives_the_others() -> None:
    topk = GroupTopK(256, 3)
    sparse = [topk.compress(torch.randn(10_000)) for _ in range(4)]
    _, stats = _run("fanout", 4, lambda c: c.allreduce_sparse(sparse[c.rank]))
    sent = [s.bytes_sent for s in stats]
    assert all(s.frames_sent == 1 for s in stats)
    assert sent[0] < 2 * sparse[0].wire_nbytes  # one compressed payload, not N-1 copies
    for i, s in enumerate(stats):
        assert s.bytes_received == sum(sent) - sent[i]


def test_hub_members_send_once_up_and_the_hub_once_down() -> None:
    topk = GroupTopK(256, 3)
    sparse = [topk.compress(torch.randn(10_000)) for _ in range(4)]
    _, stats = _run("hub", 4, lambda c: c.allreduce_sparse(sparse[c.rank]))
    assert [s.frames_sent for s in stats] == [1, 1, 1, 1]
    assert stats[0].per_peer_sent.keys() == {"*"}  # the hub broadcasts the sum
    assert all(s.per_peer_sent.keys() == {"agent-0"} for s in stats[1:])
    assert stats[0].bytes_received == sum(s.bytes_sent for s in stats[1:])
    assert all(s.bytes_received == stats[0].bytes_sent for s in stats[1:])


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_lost_member_ends_the_round_with_peer_lost_at_once(kind: str) -> None:
    errors, seconds, _ = kill_c_mid_round(lambda ch, names: KINDS[kind](ch, names, 30.0))
    assert isinstance(errors["a"], PeerLost) and errors["a"].peer == "c"
    # fanout: b waits on c too; hub: b waits on the hub, which gave up and left
    waited_on = "c" if kind == "fanout" else "a"
    assert isinstance(errors["b"], PeerLost) and errors["b"].peer == waited_on
    assert seconds < 5  # far below the 30 s deadline


def test_the_job_field_is_checked_and_named() -> None:
    with pytest.raises(SpecError, match=r"'collective'='tree'"):
        JobSpec(collective="tree")
    with pytest.raises(SpecError, match=r"'collective'='hub'.*topology='star'"):
        JobSpec(collective="hub", topology="star", aggregation="median")
    assert JobSpec().collective == "ring"


@pytest.mark.parametrize("phase", ["fan.b3", "hub-down.b3", "hub-up.b3"])
def test_broadcast_frames_keep_a_64_byte_header_and_their_tag_binds_the_job(phase: str) -> None:
    x = torch.randn(5210)
    topk = GroupTopK(256, 3, "fp16")
    total = sum((topk.compress(torch.randn(5210)).decompress() for _ in range(4)), x * 0)
    payloads = [topk.compress(x), GroupSparse.from_dense(total, 256, (0, n_groups(5210, 256)))]
    for payload in payloads:
        meta, body = encode_payload(payload)
        frame = Frame(kind="chunk", job="sim", src="agent-31", dst="*", seq=65_535,
                      round=65_535, step=0, phase=phase, meta=meta, body=body)  # fmt: skip
        data = encode_compact(frame, b"k")
        assert header_bytes(data) <= 64
        got = decode_compact(data, job="sim", src="agent-31", dsts=("agent-2", "*"), key=b"k")
        assert got.dst == "*" and got.body == body
        with pytest.raises(FrameError) as info:  # the same bytes replayed into another job
            decode_compact(data, job="sim2", src="agent-31", dsts=("agent-2", "*"), key=b"k")
        assert info.value.reason == FrameReason.UNEXPECTED


def test_simulate_runs_the_collective_it_is_given_and_refuses_others() -> None:
    from typer.testing import CliRunner

    from fedring.cli import app

    runner = CliRunner()
    bad = runner.invoke(app, ["simulate", "--collective", "tree", "--rounds", "1"])
    assert bad.exit_code == 2 and "'collective'='tree'" in " ".join(bad.output.split())
    args = ["simulate", "--agents", "3", "--rounds", "4", "--eval-every", "2", "--json"]
    runs = {c: runner.invoke(app, [*args, "--collective", c]) for c in ("fanout", "hub")}
    docs = {c: json.loads(r.stdout.strip().splitlines()[-1]) for c, r in runs.items()}
    assert docs["fanout"]["layout"] == "fanout of 3" and docs["hub"]["layout"] == "hub of 3"
    assert docs["fanout"]["identical_models"] and docs["hub"]["identical_models"]
    # both sum the same payloads in the same order: the same parameters
    assert docs["fanout"]["model_hashes"] == docs["hub"]["model_hashes"]
