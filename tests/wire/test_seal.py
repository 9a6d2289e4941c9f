"""Sealed frames (issue 27, item 5): a keyed job's bodies are unreadable without the key.

Compact frames carry every gradient a `PeerChannel` sends; control frames carry model
parameters and metrics. With a key both are sealed (`fedring.wire.seal`): what goes
on the wire shows nothing of the body, opens only under the job key, and any change
to header or body is refused with a reason. Without a key they are as before.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedring.collective.channel import PeerChannel
from fedring.collective.payloads import encode_payload
from fedring.compression import DenseChunk, GroupTopK
from fedring.counters import Counters
from fedring.transport import Deadline, InprocTransport
from fedring.wire.compact import decode_compact, encode_compact, header_bytes
from fedring.wire.errors import FrameError, FrameReason
from fedring.wire.frame import Frame, FrameLimits, decode_frame, encode_frame

KEY = b"k" * 32
WHERE = {"job": "job-1", "src": "a1", "dsts": ("a2", "*")}


def pattern(numel: int = 4096) -> np.ndarray:
    """A float32 vector whose bytes anyone would recognise: 0.5, 1.0, 1.5, ..."""
    return (np.arange(1, numel + 1, dtype="<f4") / 2).astype("<f4")


def chunk(body: bytes, seq: int = 7, **changes: object) -> Frame:
    frame = Frame(kind="chunk", job="job-1", src="a1", dst="a2", seq=seq, round=3, step=1,
                  phase="rs", meta={"codec": "dense", "numel": 1}, body=body)  # fmt: skip
    return frame.replace(**changes)


def windows(data: bytes, size: int = 8) -> set[bytes]:
    return {data[i : i + size] for i in range(0, len(data) - size + 1, 4)}


def entropy_bits(data: bytes) -> float:
    counts = Counter(data)
    return -sum(c / len(data) * math.log2(c / len(data)) for c in counts.values())


def reason_of(data: bytes, key: bytes | None, **where: object) -> FrameReason:
    with pytest.raises(FrameError) as info:
        decode_compact(data, key=key, **{**WHERE, **where})  # type: ignore[arg-type]
    return info.value.reason


# --------------------------------------------------------------------------- secrecy


def test_a_keyed_compact_frame_shows_nothing_of_a_known_float_pattern() -> None:
    payload = DenseChunk(4096, 0, torch.from_numpy(pattern()))
    meta, body = encode_payload(payload)
    frame = Frame(kind="chunk", job="job-1", src="a1", dst="*", seq=0, meta=meta, body=body)
    clear = encode_compact(frame)
    assert body in clear  # the control: without a key the pattern is there to see
    sealed = encode_compact(frame, KEY)
    assert not windows(body) & windows(sealed), "8 bytes of the pattern are on the wire"
    assert decode_compact(sealed, key=KEY, **WHERE).body == body  # type: ignore[arg-type]


def test_a_keyed_control_frame_shows_nothing_of_a_model_blob() -> None:
    blob = pattern(20_000).tobytes()
    doc = b'{"round":12,"accuracy":0.9731}'
    frame = Frame(kind="model", job="job-1", src="coordinator", dst="a1", seq=1,
                  meta={"doc": len(doc)}, body=doc + blob)  # fmt: skip
    sealed = encode_frame(frame, KEY)
    assert doc not in sealed and b"0.9731" not in sealed
    assert not windows(blob) & windows(sealed)
    assert frame.body in encode_frame(frame)  # the control
    assert decode_frame(sealed, KEY) == frame


def test_sealed_bytes_look_random_even_for_a_constant_body() -> None:
    """A zero body sealed frame after frame: ~8 bits a byte (a clear one: 0)."""
    sealed = b"".join(
        encode_compact(chunk(bytes(1024), seq=s), KEY)[-1024 - 16 : -16] for s in range(64)
    )
    assert entropy_bits(sealed) > 7.99
    assert entropy_bits(bytes(1024)) == 0


def test_a_repeated_header_does_not_repeat_the_keystream() -> None:
    """A restarted sender counts seq from 0 again, and every member seals under the one
    job key: two different bodies under one header must not give away their XOR (as a
    stream cipher with a repeated nonce would)."""
    a, b = pattern(256).tobytes(), (pattern(256) * 3).astype("<f4").tobytes()
    sa, sb = (encode_compact(chunk(x), KEY)[-len(a) - 16 : -16] for x in (a, b))
    xor_plain = bytes(x ^ y for x, y in zip(a, b, strict=True))
    xor_sealed = bytes(x ^ y for x, y in zip(sa, sb, strict=True))
    assert xor_sealed != xor_plain
    assert not windows(xor_plain) & windows(xor_sealed)


def test_no_two_frames_of_a_sender_share_sealed_bytes() -> None:
    """The nonce differs frame to frame (it is drawn from the header, seq included) and
    sender to sender: one body sent 200 times, by two senders, seals 400 ways."""
    body = pattern(64).tobytes()
    sealed = [encode_compact(chunk(body, seq=s, src=src), KEY)[-len(body) : -16]
              for s in range(200) for src in ("a1", "a3")]  # fmt: skip
    blocks = [s[i : i + 16] for s in sealed for i in range(0, len(s), 16)]
    assert len(set(blocks)) == len(blocks)  # not even a block of 16 in common


# --------------------------------------------------------------------------- refusals


def test_a_wrong_key_is_refused_with_a_reason() -> None:
    sealed = encode_compact(chunk(pattern(64).tobytes()), KEY)
    assert reason_of(sealed, b"x" * 32) is FrameReason.BAD_MAC
    with pytest.raises(FrameError, match="does not open"):
        decode_compact(sealed, key=b"x" * 32, **WHERE)  # type: ignore[arg-type]
    assert reason_of(sealed, None) is FrameReason.BAD_MAC  # sealed, and this job has no key
    control = encode_frame(chunk(b"doc").replace(kind="metrics", meta={"doc": 3}), KEY)
    with pytest.raises(FrameError) as info:
        decode_frame(control, b"x" * 32)
    assert info.value.reason is FrameReason.BAD_MAC and "does not open" in str(info.value)


def test_every_header_byte_is_bound_by_the_seal() -> None:
    """A flipped bit anywhere in the header is refused: the route as `unexpected` (the
    frame is for someone else), the version as no longer sealed, the rest as bad_mac."""

    def expected(at: int) -> FrameReason:
        if at == 1:
            return FrameReason.MALFORMED  # a flag no sealed frame has
        if 2 <= at < 6:
            return FrameReason.UNEXPECTED  # the route
        return FrameReason.BAD_MAC  # the version (now "not sealed"), the fields' length, fields

    sealed = encode_compact(chunk(pattern(64).tobytes()), KEY)
    assert header_bytes(sealed) - 16 > 10
    for at in range(header_bytes(sealed) - 16):
        bad = bytearray(sealed)
        bad[at] ^= 0x01
        assert reason_of(bytes(bad), KEY) is expected(at), at


def test_a_body_moved_under_another_header_does_not_open() -> None:
    body = pattern(64).tobytes()
    one, two = (encode_compact(chunk(body, seq=s), KEY) for s in (10, 11))
    n = len(body) + 16
    assert reason_of(one[:-n] + two[-n:], KEY) is FrameReason.BAD_MAC
    assert reason_of(encode_compact(chunk(body), KEY), KEY, job="job-2") is FrameReason.UNEXPECTED


def test_an_oversized_sealed_frame_is_refused_before_it_is_opened(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def never(*_: object) -> bytes:
        raise AssertionError("opened before the size check")

    limits = FrameLimits(max_frame_bytes=8192)
    big = encode_compact(chunk(bytes(9000)), KEY)
    monkeypatch.setattr("fedring.wire.compact.open_sealed", never)
    with pytest.raises(FrameError) as info:
        decode_compact(big, key=KEY, limits=limits, **WHERE)  # type: ignore[arg-type]
    assert info.value.reason is FrameReason.OVERSIZE


def test_a_channel_counts_a_frame_that_does_not_open() -> None:
    hub = InprocTransport()
    names = ("a1", "a2")
    ends = {n: hub.connect(n) for n in names}
    good, other = (PeerChannel(ends["a1"], "job-1", key=k) for k in (KEY, b"x" * 32))
    receiver = PeerChannel(ends["a2"], "job-1", key=KEY, counters=Counters())
    payload = GroupTopK(256, 4, "fp32").compress(torch.randn(1024))
    deadline = Deadline.after(5)
    other.send("a2", payload, round=0, step=0, phase="rs", deadline=deadline)
    good.send("a2", payload, round=0, step=0, phase="rs", deadline=deadline)
    got = receiver.recv("a1", round=0, step=0, phase="rs", deadline=deadline)
    assert got.numel == payload.numel
    assert receiver.counters.snapshot().get("frame_bad_mac") == 1


# --------------------------------------------------------------------------- round trips


@settings(max_examples=200, deadline=None)
@given(
    body=st.binary(max_size=3000),
    seq=st.integers(0, 2**63 - 1),
    round=st.integers(0, 2**40),
    phase=st.text(max_size=20),
    dst=st.sampled_from(["a2", "*"]),
    key=st.binary(min_size=1, max_size=64),
)
def test_sealed_compact_round_trip(
    body: bytes, seq: int, round: int, phase: str, dst: str, key: bytes
) -> None:
    frame = chunk(body, seq=seq, round=round, phase=phase, dst=dst)
    data = encode_compact(frame, key)
    assert decode_compact(data, key=key, **WHERE) == frame  # type: ignore[arg-type]
    assert len(data) == header_bytes(data) + len(body)
    assert reason_of(data, key + b"!") is FrameReason.BAD_MAC


@settings(max_examples=100, deadline=None)
@given(
    body=st.binary(max_size=3000),
    kind=st.sampled_from(["model", "metrics", "ack", "manifest", "bye"]),
    seq=st.integers(0, 2**63 - 1),
    part=st.integers(1, 8).flatmap(lambda n: st.tuples(st.integers(0, n - 1), st.just(n))),
    key=st.binary(min_size=1, max_size=64),
)
def test_sealed_control_round_trip(
    body: bytes, kind: str, seq: int, part: tuple[int, int], key: bytes
) -> None:
    frame = Frame(kind=kind, job="job-1", src="coordinator", dst="a1", seq=seq, part=part,
                  meta={"doc": len(body)}, body=body)  # fmt: skip
    data = encode_frame(frame, key)
    assert decode_frame(data, key) == frame
    with pytest.raises(FrameError) as info:
        decode_frame(data, key + b"!")
    assert info.value.reason is FrameReason.BAD_MAC
