"""`mqtt_inbox`: queues bounded in items and payload bytes, filled without blocking."""

from __future__ import annotations

from fedring.counters import Counters
from fedring.transport.base import Delivery, MembershipEvent
from fedring.transport.mqtt_inbox import Control, DataItem, Inbox, Inboxes


def test_an_inbox_refuses_what_does_not_fit_and_counts_its_bytes() -> None:
    box: Inbox[DataItem] = Inbox(max_items=3, max_bytes=10)
    assert box.offer(("j", Delivery("a", b"123456")))
    assert not box.offer(("j", Delivery("a", b"12345")))  # 11 bytes
    assert box.offer(MembershipEvent("joined", "a")) and box.offer(Delivery("b", b"1234"))
    assert box.queued_bytes == 10
    assert not box.offer(MembershipEvent("left", "a"))  # 4 items
    box.get_nowait()
    assert box.queued_bytes == 4 and box.qsize() == 2


def test_a_full_queue_drops_and_counts_and_events_reach_every_reader() -> None:
    counters = Counters()
    boxes = Inboxes("a1", 2, 100, counters)
    private = boxes.open_private("star")
    boxes.emit("a2", [MembershipEvent("joined", "a2"), MembershipEvent("lost", "a2")])
    assert boxes.data.qsize() == private.qsize() == boxes.control.qsize() == 2
    assert boxes.control.get_nowait() == Control("member", "a2", event=MembershipEvent(
        "joined", "a2"))  # fmt: skip
    boxes.offer(boxes.data, ("j", Delivery("a2", b"x")), "topic")
    assert counters.get("inbox_full") == 1
    boxes.offer(boxes.control, Control("hello", "a3", b"hi"), "topic")
    assert boxes.queued_bytes == 2
    boxes.close_private("star")
    boxes.interrupt("j")  # put, not offered: wakes a full queue's reader too
    assert boxes.private == {} and boxes.data.qsize() == 3
