"""In-process transport: delivery, deadlines, membership events, kill, byte accounting."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from fedring.transport import (
    Deadline,
    Delivery,
    EndpointClosed,
    InprocTransport,
    MembershipEvent,
    PeerUnreachable,
    TransportTimeout,
)


def _drain_events(ep, n: int) -> list[MembershipEvent]:  # type: ignore[no-untyped-def]
    return [ep.recv(Deadline.after(1)) for _ in range(n)]


def test_frames_arrive_in_order_with_their_sender_and_are_counted() -> None:
    hub = InprocTransport()
    a, b = hub.connect("a"), hub.connect("b")
    assert _drain_events(a, 1) == [MembershipEvent("joined", "b")]
    for i in range(3):
        a.send("b", bytes([i]) * 10, Deadline.after(1))
    got = [b.recv(Deadline.after(1)) for _ in range(3)]
    assert got == [Delivery("a", bytes([i]) * 10) for i in range(3)]
    assert a.stats.bytes_sent == 30 and a.stats.frames_sent == 3 and b.stats.bytes_received == 30
    assert a.stats.per_peer_sent == {"b": 30}
    assert a.peers() == frozenset({"b"})


def test_recv_times_out_at_its_deadline() -> None:
    a = InprocTransport().connect("a")
    start = time.monotonic()
    with pytest.raises(TransportTimeout):
        a.recv(Deadline.after(0.1))
    assert time.monotonic() - start >= 0.09


def test_a_full_inbox_makes_send_time_out() -> None:
    hub = InprocTransport(max_queue=2)
    a, _ = hub.connect("a"), hub.connect("b")
    a.send("b", b"1", Deadline.after(1))
    a.send("b", b"2", Deadline.after(1))
    with pytest.raises(TransportTimeout, match="full"):
        a.send("b", b"3", Deadline.after(0.05))


def test_sending_to_an_unknown_endpoint_fails() -> None:
    a = InprocTransport().connect("a")
    with pytest.raises(PeerUnreachable, match="'nobody'"):
        a.send("nobody", b"x", Deadline.after(1))


def test_close_says_left_and_kill_says_lost() -> None:
    hub = InprocTransport()
    a, b, c = hub.connect("a"), hub.connect("b"), hub.connect("c")
    _drain_events(a, 2)
    b.close()
    hub.kill("c")
    assert _drain_events(a, 2) == [MembershipEvent("left", "b"), MembershipEvent("lost", "c")]
    with pytest.raises(EndpointClosed):
        c.send("a", b"x", Deadline.after(1))
    with pytest.raises(PeerUnreachable):
        a.send("c", b"x", Deadline.after(1))


def test_kill_wakes_a_blocked_receiver() -> None:
    hub = InprocTransport()
    victim = hub.connect("v")
    raised: list[BaseException] = []

    def wait() -> None:
        try:
            victim.recv(Deadline.after(30))
        except BaseException as exc:
            raised.append(exc)

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.05)
    hub.kill("v")
    t.join(2)
    assert not t.is_alive() and isinstance(raised[0], EndpointClosed)


@pytest.mark.parametrize("name", ["", "a/b", "x+", "#"])
def test_names_that_cannot_be_topics_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="endpoint name"):
        InprocTransport().connect(name)


def test_a_name_cannot_be_taken_twice_and_kill_needs_a_live_name() -> None:
    hub = InprocTransport()
    hub.connect("a")
    with pytest.raises(ValueError, match="already connected"):
        hub.connect("a")
    with pytest.raises(ValueError, match="no endpoint 'zz'"):
        hub.kill("zz")


def test_kill_does_not_block_on_a_full_inbox() -> None:
    hub = InprocTransport(max_queue=2)
    a, victim = hub.connect("a"), hub.connect("v")
    a.send("v", b"1", Deadline.after(1))
    a.send("v", b"2", Deadline.after(1))
    done = threading.Event()
    threading.Thread(target=lambda: (hub.kill("v"), done.set()), daemon=True).start()
    assert done.wait(2), "kill() blocked on the victim's full inbox"
    with pytest.raises(EndpointClosed):
        victim.recv(Deadline.after(1))


def test_a_full_inbox_still_learns_that_a_peer_died_after_its_frames() -> None:
    hub = InprocTransport(max_queue=1)
    x = hub.connect("x")
    y = hub.connect("y")
    y.send("x", b"last words", Deadline.after(1))  # x's inbox is now full of frames
    hub.kill("y")
    got = [x.recv(Deadline.after(1)) for _ in range(3)]
    assert got == [
        MembershipEvent("joined", "y"),
        Delivery("y", b"last words"),
        MembershipEvent("lost", "y"),
    ]


@pytest.mark.parametrize("cooperative", [True, False])
def test_cooperative_hub_runs_one_participant_at_a_time(cooperative: bool) -> None:
    hub = InprocTransport(cooperative=cooperative)
    a, b = hub.connect("a"), hub.connect("b")
    running, overlap = [0], [False]
    got: list[bytes] = []

    def work(action) -> None:  # type: ignore[no-untyped-def]
        running[0] += 1  # between waits, no other participant may be running
        time.sleep(0.001)  # releases the GIL, not the baton: the other thread could run now
        overlap[0] |= running[0] > 1
        action()
        running[0] -= 1

    def participant(me, other: str) -> None:  # type: ignore[no-untyped-def]
        with hub.baton.turn() if hub.baton else contextlib.nullcontext():
            for i in range(50):  # ring-style steps: both send, then both receive
                work(lambda i=i: me.send(other, bytes([i]), Deadline.after(5)))
                item = me.recv(Deadline.after(5))
                while not isinstance(item, Delivery):
                    item = me.recv(Deadline.after(5))
                got.append(item.data)

    threads = [threading.Thread(target=participant, args=(a, "b")),
               threading.Thread(target=participant, args=(b, "a"))]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(got) == 100
    assert overlap[0] is not cooperative  # without the baton the work does overlap
    outsider = hub.connect("c")  # a thread outside turn() is not held up by the baton
    with pytest.raises(TransportTimeout):
        outsider.recv(Deadline.after(0.05))
