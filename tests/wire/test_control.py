"""Control frames: a frame signed with another job's key is refused as such."""

from __future__ import annotations

import logging

import pytest

from fedring.counters import Counters
from fedring.wire.control import ControlCodec


def test_a_wrong_key_is_reported_as_a_wrong_mac_not_as_a_missing_key(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sender = ControlCodec("coordinator", key=b"k" * 32)
    [frame] = sender.encode("metrics", "job-1", "a0", {"round": 1})
    receiver = ControlCodec("a0", key=b"x" * 32, counters=Counters())
    with caplog.at_level(logging.WARNING):
        assert receiver.decode("coordinator", frame) is None
    assert receiver.counters.snapshot() == {"frame_bad_mac": 1}
    assert "MAC of frame" in caplog.text and "has no key" not in caplog.text


def test_the_right_key_passes_and_an_unsigned_manifest_is_taken() -> None:
    sender = ControlCodec("coordinator", key=b"k" * 32)
    receiver = ControlCodec("a0", key=b"k" * 32)
    [frame] = sender.encode("metrics", "job-1", "a0", {"round": 1})
    msg = receiver.decode("coordinator", frame)
    assert msg is not None and msg.doc == {"round": 1} and msg.signed
    [manifest] = sender.encode("manifest", "job-2", "a0", {"key": "..."}, sign=False)
    got = receiver.decode("coordinator", manifest)
    assert got is not None and got.kind == "manifest" and not got.signed
