"""A ring that loses a member, goes silent, or gets bad frames fails fast and says why."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from fedring.collective import CollectiveTimeout, PeerChannel, PeerLost, Ring, run_local_ring
from fedring.compression import DenseChunk
from fedring.counters import Counters
from fedring.transport import Deadline, InprocTransport
from tests.collective.mid_round import kill_c_mid_round


def _ring(
    hub: InprocTransport,
    names: tuple[str, ...],
    me: str,
    key: bytes,
    timeout_s: float,
    counters: Counters | None = None,
) -> Ring:
    return Ring(
        PeerChannel(hub.connect(me), "job", key=key, counters=counters), names, timeout_s=timeout_s
    )


def test_a_killed_neighbour_is_seen_at_once_not_at_the_deadline() -> None:
    errors, seconds, rings = kill_c_mid_round(lambda ch, names: Ring(ch, names, timeout_s=30.0))
    assert isinstance(errors["a"], PeerLost) and errors["a"].peer == "c"  # c is a's left
    assert isinstance(errors["b"], PeerLost) and errors["b"].peer == "a"  # then a left b's side
    assert seconds < 5  # far below the 30 s deadline
    assert rings["a"].channel.counters.get("peer_lost") == 1


def test_a_loss_queued_before_the_peer_came_back_is_stale_for_a_new_channel() -> None:
    """A daemon saw a peer die during one job and takes the next with the restarted
    peer: the old loss, still queued, must not end the new job (a pipeline job over
    MQTT failed so in CI). A channel that heard the old peer still learns of the loss
    (`test_a_restarted_peer_is_heard_again`)."""
    hub = InprocTransport()
    a = hub.connect("a")
    hub.connect("b").close()  # a's queue: b left
    b = PeerChannel(hub.connect("b"), "job", key=b"k")  # b is back: a's queue: b joined
    chunk = DenseChunk(4, 0, torch.ones(4))
    b.send("a", chunk, round=0, step=0, phase="p", deadline=Deadline.after(5))
    got = PeerChannel(a, "job", key=b"k").recv("b", round=0, step=0, phase="p",
                                               deadline=Deadline.after(5))  # fmt: skip
    assert torch.equal(got.decompress(), torch.ones(4))


def test_a_silent_neighbour_times_out_at_the_deadline() -> None:
    hub = InprocTransport()
    ring = _ring(hub, ("a", "b"), "a", b"k", timeout_s=0.3)
    hub.connect("b")
    start = time.monotonic()
    with pytest.raises(CollectiveTimeout, match="from 'b'"):
        ring.allreduce_dense(torch.ones(4))
    assert 0.25 < time.monotonic() - start < 3
    assert ring.channel.counters.get("timeout") == 1


def test_frames_with_a_bad_mac_are_refused_counted_and_named_in_the_timeout() -> None:
    hub = InprocTransport()
    counters = Counters()
    a = _ring(hub, ("a", "b"), "a", b"right-key", timeout_s=0.5, counters=counters)
    b = _ring(hub, ("a", "b"), "b", b"wrong-key", timeout_s=0.5)
    result: dict[str, BaseException] = {}

    def run_b() -> None:
        try:
            b.allreduce_dense(torch.ones(4))
        except BaseException as exc:
            result["b"] = exc

    t = threading.Thread(target=run_b)
    t.start()
    with pytest.raises(CollectiveTimeout, match="bad_mac"):
        a.allreduce_dense(torch.ones(4))
    t.join(5)
    assert counters.get("frame_bad_mac") >= 1


def test_a_payload_of_the_wrong_shape_is_refused() -> None:
    hub = InprocTransport()
    counters = Counters()
    a = _ring(hub, ("a", "b"), "a", b"k", timeout_s=0.5, counters=counters)
    b = _ring(hub, ("a", "b"), "b", b"k", timeout_s=0.5)
    b_failed: list[BaseException] = []

    def run_b() -> None:
        try:
            b.allreduce_dense(torch.ones(10))
        except CollectiveTimeout as exc:  # a's chunks do not fit b either
            b_failed.append(exc)

    t = threading.Thread(target=run_b)
    t.start()
    with pytest.raises(CollectiveTimeout, match="numel'=10 not in"):
        a.allreduce_dense(torch.ones(8))  # b sends chunks of a 10-entry vector
    t.join(5)
    assert counters.get("frame_shape_mismatch") >= 1  # refused before decoding its arrays
    assert b_failed, "b should have refused a's chunks too"


def test_ring_membership_is_checked() -> None:
    hub = InprocTransport()
    ch = PeerChannel(hub.connect("x"), "job")
    with pytest.raises(ValueError, match="not in the ring"):
        Ring(ch, ("a", "b"))
    with pytest.raises(ValueError, match="repeat"):
        Ring(ch, ("x", "a", "x"))


def test_a_chunk_for_the_wrong_range_is_refused_as_unexpected() -> None:
    hub = InprocTransport()
    counters = Counters()
    a = _ring(hub, ("a", "b"), "a", b"k", timeout_s=0.5, counters=counters)
    b = PeerChannel(hub.connect("b"), "job", key=b"k")
    # a awaits entries [4, 8) of an 8-entry vector at rs step 0; b sends [0, 4)
    wrong = DenseChunk(8, 0, torch.ones(4))
    b.send("a", wrong, round=0, step=0, phase="rs", deadline=Deadline.after(1))
    with pytest.raises(CollectiveTimeout, match="unexpected"):
        a.allreduce_dense(torch.ones(8))
    assert counters.get("frame_unexpected") == 1


def test_a_member_that_never_connected_is_a_lost_peer() -> None:
    hub = InprocTransport()
    ring = _ring(hub, ("a", "b"), "a", b"k", timeout_s=5.0)
    with pytest.raises(PeerLost, match="'b'"):
        ring.allreduce_dense(torch.ones(4))


def test_a_restarted_peer_is_heard_again() -> None:
    hub = InprocTransport()
    receiver = PeerChannel(hub.connect("r"), "job", key=b"k")
    first = PeerChannel(hub.connect("s"), "job", key=b"k")
    chunk = DenseChunk(4, 0, torch.ones(4))
    for step in range(5):
        first.send("r", chunk, round=0, step=step, phase="p", deadline=Deadline.after(1))
        receiver.recv("s", round=0, step=step, phase="p", deadline=Deadline.after(1))
    first.endpoint.close()
    again = PeerChannel(hub.connect("s"), "job", key=b"k")  # counts seq from 0 again
    again.send("r", chunk, round=1, step=0, phase="p", deadline=Deadline.after(1))
    with pytest.raises(PeerLost):  # first the receiver learns that the old 's' left...
        receiver.recv("s", round=1, step=0, phase="p", deadline=Deadline.after(1))
    # ...then, re-synchronised, it waits again and hears the new 's' from seq 0
    got = receiver.recv("s", round=1, step=0, phase="p", deadline=Deadline.after(1))
    assert torch.equal(got.decompress(), torch.ones(4))
    assert receiver.counters.get("duplicate") == 0


def test_run_local_ring_reports_the_root_cause_not_the_neighbours_reaction() -> None:
    def member(ring: Ring) -> torch.Tensor:
        if ring.rank == 2:
            raise RuntimeError("the real cause")
        return ring.allreduce_dense(torch.ones(8))

    with pytest.raises(RuntimeError, match="the real cause"):
        run_local_ring(4, member, timeout_s=5.0)
