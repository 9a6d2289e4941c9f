"""Control frames: a frame sealed with another job's key is refused as such."""

from __future__ import annotations

import itertools
import logging

import pytest

from fedring.counters import Counters
from fedring.wire.control import ControlCodec
from fedring.wire.frame import Frame, encode_frame


def test_a_wrong_key_is_reported_as_a_wrong_mac_not_as_a_missing_key(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sender = ControlCodec("coordinator", key=b"k" * 32)
    [frame] = sender.encode("metrics", "job-1", "a0", {"round": 1})
    receiver = ControlCodec("a0", key=b"x" * 32, counters=Counters())
    with caplog.at_level(logging.WARNING):
        assert receiver.decode("coordinator", frame) is None
    assert receiver.counters.snapshot() == {"frame_bad_mac": 1}
    assert "does not open" in caplog.text and "has no key" not in caplog.text


def test_the_right_key_passes_and_an_unsigned_manifest_is_taken() -> None:
    sender = ControlCodec("coordinator", key=b"k" * 32)
    receiver = ControlCodec("a0", key=b"k" * 32)
    [frame] = sender.encode("metrics", "job-1", "a0", {"round": 1})
    msg = receiver.decode("coordinator", frame)
    assert msg is not None and msg.doc == {"round": 1} and msg.signed
    [manifest] = sender.encode("manifest", "job-2", "a0", {"key": "..."}, sign=False)
    got = receiver.decode("coordinator", manifest)
    assert got is not None and got.kind == "manifest" and not got.signed


_SEQ = itertools.count(1)


def _raw_control(kind: str, src: str, text: bytes, key: bytes | None = None) -> bytes:
    """A control frame whose document is `text` as it is (the codec's own encoder
    would write only valid JSON)."""
    frame = Frame(kind=kind, job="job-1", src=src, dst="coordinator", seq=next(_SEQ),
                  meta={"doc": len(text)}, body=text)  # fmt: skip
    return encode_frame(frame, key)


@pytest.mark.parametrize("opening", [b"[", b'{"a":'])
def test_a_deeply_nested_document_is_a_counted_refusal_not_a_crash(opening: bytes) -> None:
    """Issue 27: ``json.loads`` raised RecursionError at depth >= 1000, which ended the
    coordinator: an unsigned hello is read with no key at all, and a member holds the
    job key."""
    closing = b"]" if opening == b"[" else b"}"
    deep = opening * 5000 + b"1" + closing * 5000
    keyless = ControlCodec("coordinator", counters=Counters())  # how hellos are read
    for text in (deep, opening * 5000, b'{"a":' + opening * 1000 + closing * 1000 + b"}"):
        assert keyless.decode("mallory", _raw_control("hello", "mallory", text)) is None
    assert keyless.counters.snapshot() == {"frame_too_deep": 3}
    keyed = ControlCodec("coordinator", key=b"k" * 32, counters=Counters())
    assert keyed.decode("a1", _raw_control("bye", "a1", deep, key=b"k" * 32)) is None
    assert keyed.counters.snapshot() == {"frame_too_deep": 1}


def test_an_unsigned_frame_that_is_not_the_coordinators_manifest_is_refused() -> None:
    """Only the coordinator hands out a key unsigned: an agent's unsigned "manifest"
    (here on the metrics topic, read before its kind) is a missing MAC."""
    receiver = ControlCodec("coordinator", key=b"k" * 32, counters=Counters())
    frame = _raw_control("manifest", "mallory", b'{"round":3,"sha256":"x","resynced":true}')
    assert receiver.decode("mallory", frame) is None
    assert receiver.counters.snapshot() == {"frame_bad_mac": 1}
