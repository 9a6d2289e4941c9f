"""Compact frames (`fedring.wire.compact`): size, round trips, one test per refusal, fuzz.

The header bound is the issue's acceptance line: at most 64 bytes besides the body
(header and tag) for the ring's and the gather's frames, measured on encoded frames
with counters and a bucket phase as large as long jobs use. A keyed job's frames
are sealed (version 3): `tests/wire/test_seal.py` checks what the seal hides.
"""

from __future__ import annotations

import hashlib
import hmac
import random
import struct
from typing import Any

import msgpack
import pytest
import torch

from fedring.collective.payloads import decode_payload, encode_payload
from fedring.collective.ring import chunk_bounds
from fedring.compression import DenseChunk, GroupSparse, GroupTopK, PayloadLimits, SignQuantizer
from fedring.compression.payload import Payload
from fedring.compression.sparse import n_groups
from fedring.wire.chunks import Reassembler, split_payload
from fedring.wire.compact import (
    COMPACT_VERSION,
    KEYED,
    SEALED_VERSION,
    SPLIT,
    TAG_BYTES,
    context,
    decode_compact,
    encode_compact,
    header_bytes,
)
from fedring.wire.errors import FrameError, FrameReason
from fedring.wire.frame import Frame, FrameLimits, decode_frame, encode_frame
from fedring.wire.seal import SEAL_TAG_BYTES, seal

KEY = b"job-key"
SMALL = FrameLimits(max_frame_bytes=8192)


def _x(numel: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def frame_of(payload: Payload, **changes: Any) -> Frame:
    meta, body = encode_payload(payload)
    frame = Frame(kind="chunk", job="sim", src="agent-31", dst="agent-30", seq=65_535,
                  round=65_535, step=30, phase="rs.b3", meta=meta, body=body)  # fmt: skip
    return frame.replace(**changes)


def decode(data: bytes, key: bytes | None = KEY, **kw: Any) -> Frame:
    limits = kw.pop("limits", None)
    where = {"job": "sim", "src": "agent-31", "dsts": ("agent-30", "*"), **kw}
    return decode_compact(data, key=key, limits=limits, **where)


def reason_of(data: bytes, key: bytes | None = KEY, **kw: Any) -> FrameReason:
    with pytest.raises(FrameError) as info:
        decode(data, key, **kw)
    return info.value.reason


def ring_payloads(numel: int, world: int) -> list[Payload]:
    """Every chunk the bounded, exact and dense rings send, and the gather's payload."""
    x = _x(numel)
    topk = GroupTopK.from_density(0.01, 256, "fp16")
    spans = chunk_bounds(n_groups(numel, 256), world)
    out: list[Payload] = [topk.compress(x, groups=s) for s in spans]
    out += [GroupTopK.from_density(0.01, 256, "int8").compress(x, groups=spans[-1])]
    out += [GroupSparse.from_dense(topk.compress(x).decompress(), 256, spans[0])]
    a, b = chunk_bounds(numel, world)[-1]
    out += [DenseChunk(numel, a, x[a:b].clone())]
    return [*out, topk.compress(x)]  # the gather sends the whole payload


# --------------------------------------------------------------------------- size


@pytest.mark.parametrize("key", [KEY, None], ids=["key", "no-key"])
@pytest.mark.parametrize(
    "numel, world", [(5210, 4), (5210, 8), (1_000_000, 32)], ids=["cnn-4", "cnn-8", "1M-32"]
)
def test_ring_and_gather_headers_are_at_most_64_bytes(
    numel: int, world: int, key: bytes | None
) -> None:
    limits = FrameLimits()
    for payload in ring_payloads(numel, world):
        frame = frame_of(payload)
        if len(frame.body) > limits.max_body_bytes:
            continue  # split payloads are the next test's
        data = encode_compact(frame, key)
        assert header_bytes(data) == len(data) - len(frame.body)
        assert header_bytes(data) <= 64, (type(payload).__name__, header_bytes(data))
        v1 = len(encode_frame(frame)) - len(frame.body)
        assert v1 > 3 * header_bytes(data)  # what the version-1 envelope costs


def test_a_part_of_a_split_payload_adds_its_part_fields() -> None:
    payload = GroupTopK(256, 16, "fp32").compress(_x(60_000))
    frames = split_payload(frame_of(payload), encode_payload(payload)[1], 65_535, SMALL)
    assert len(frames) > 3
    sizes = {header_bytes(encode_compact(f, KEY)) for f in frames}
    single = header_bytes(encode_compact(frame_of(GroupTopK(256, 16, "fp32").compress(_x(500)))))
    assert max(sizes) <= 64 + 16 and min(sizes) > single


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("key", [KEY, None], ids=["key", "no-key"])
@pytest.mark.parametrize(
    "payload",
    [
        GroupTopK(100, 5, "fp16").compress(_x(1000)),
        GroupTopK(256, 4, "int8").compress(_x(1500), groups=(1, 5)),
        GroupTopK(1000, 3, "bf16").compress(_x(2500)),
        GroupTopK(64, 2, "sign").compress(_x(700)),
        GroupSparse.from_dense(torch.where(_x(600) > 1, _x(600, 1), torch.zeros(600)), 64, (0, 10)),
        DenseChunk(400, 64, _x(96).to(torch.float16)),
        SignQuantizer(group_size=16).compress(_x(100)),
    ],
    ids=["topk-fp16", "topk-int8", "topk-u2-bf16", "topk-sign", "sparse", "dense", "sign"],
)
def test_round_trip(payload: Payload, key: bytes | None) -> None:
    frame = frame_of(payload)
    got = decode(encode_compact(frame, key), key)
    assert got == frame
    decoded = decode_payload(got.meta, bytearray(got.body), PayloadLimits())
    assert torch.equal(decoded.decompress(), payload.decompress())


def test_meta_outside_the_tables_travels_as_itself() -> None:
    meta = {"codec": "my-codec", "numel": 3, "note": "hi", "arrays": {"w": ["f8", 2]}}
    frame = Frame(kind="chunk", job="j", src="a", dst="*", seq=0, meta=meta, body=b"x")
    assert decode_compact(encode_compact(frame), job="j", src="a", dsts=("b", "*")) == frame


@pytest.mark.parametrize("key", [KEY, None], ids=["key", "no-key"])
def test_split_round_trip(key: bytes | None) -> None:
    payload = GroupTopK(256, 16, "fp32").compress(_x(60_000))
    _, body = encode_payload(payload)
    frames = split_payload(frame_of(payload), body, 100, SMALL)
    encoded = [encode_compact(f, key) for f in frames]
    random.Random(1).shuffle(encoded)
    parts = Reassembler(SMALL)
    done = [parts.add(decode(e, key, limits=SMALL)) for e in encoded]
    assert all(d is None for d in done[:-1]) and done[-1] is not None
    head, joined = done[-1]
    assert bytes(joined) == body and head.seq == 100
    assert torch.equal(
        decode_payload(head.meta, joined, PayloadLimits()).decompress(), payload.decompress()
    )


def test_parts_of_two_payloads_under_one_message_are_refused() -> None:
    one, two = (GroupTopK(256, 16, "fp32").compress(_x(60_000, s)) for s in (1, 2))
    a = split_payload(frame_of(one), encode_payload(one)[1], 0, SMALL)
    b = split_payload(frame_of(two), encode_payload(two)[1], 0, SMALL)
    parts = Reassembler(SMALL)
    with pytest.raises(FrameError) as info:
        for f in [*a[:-1], b[-1]]:
            parts.add(decode(encode_compact(f, KEY), limits=SMALL))
    assert info.value.reason in (FrameReason.BAD_PART, FrameReason.BAD_SHA256)


# --------------------------------------------------------------------------- refusals


GOOD = encode_compact(frame_of(GroupTopK(100, 5, "fp16").compress(_x(1000))), KEY)
GOOD_NO_KEY = encode_compact(frame_of(GroupTopK(100, 5, "fp16").compress(_x(1000))))


def forge(fields: Any, flags: int = 0, key: bytes | None = KEY, body: bytes = b"") -> bytes:
    """A frame with a valid seal around whatever `fields` say: a peer holding the key."""
    return forge_raw(msgpack.packb(fields, use_bin_type=True), flags, key, body)


def forge_raw(packed: bytes, flags: int = 0, key: bytes | None = KEY, body: bytes = b"") -> bytes:
    ctx, route = context("sim", "agent-31", "agent-30")
    version = COMPACT_VERSION if key is None else SEALED_VERSION
    head = struct.pack("<BB4sB", version, flags, route, len(packed)) + packed
    if key is not None:
        return head + seal(key, ctx + head, body)
    return head + hashlib.sha256(ctx + head + body).digest()[:TAG_BYTES] + body


def hmac_v2(fields: Any, key: bytes = KEY, body: bytes = b"x") -> bytes:
    """A keyed frame as it was before sealing: version 2, an HMAC tag, the body in the clear."""
    packed = msgpack.packb(fields, use_bin_type=True)
    ctx, route = context("sim", "agent-31", "agent-30")
    head = struct.pack("<BB4sB", COMPACT_VERSION, KEYED, route, len(packed)) + packed
    tag = hmac.new(key, ctx + head + body, hashlib.sha256).digest()[:TAG_BYTES]
    return head + tag + body


def test_a_forged_good_frame_is_accepted() -> None:  # the forge helper itself is right
    assert decode(forge([1, 2, 3, "rs", 0], body=b"x")).body == b"x"
    assert decode(forge([1, 2, 3, "rs", 0], key=None, body=b"x"), None).body == b"x"


@pytest.mark.parametrize("cut", [0, 1, 6, 7, 20, -len(GOOD) + header_bytes(GOOD) - 1])
def test_truncated(cut: int) -> None:
    assert reason_of(GOOD[:cut]) is FrameReason.TRUNCATED


@pytest.mark.parametrize("cut", [-1, -10])
def test_truncated_body_fails_the_tag(cut: int) -> None:
    assert reason_of(GOOD[:cut]) is FrameReason.BAD_MAC
    assert reason_of(GOOD_NO_KEY[:cut], None) is FrameReason.BAD_SHA256


def test_bad_version() -> None:
    v1 = encode_frame(decode(GOOD), KEY)
    assert reason_of(v1) is FrameReason.BAD_VERSION
    with pytest.raises(FrameError, match="version-1"):
        decode(v1)
    assert reason_of(b"\x04" + GOOD[1:]) is FrameReason.BAD_VERSION
    for ours in (GOOD, GOOD_NO_KEY):  # and the version-1 decoder refuses ours
        with pytest.raises(FrameError) as info:
            decode_frame(ours, KEY)
        assert info.value.reason is FrameReason.BAD_VERSION


@pytest.mark.parametrize("key", [KEY, None], ids=["key", "no-key"])
def test_a_keyed_frame_from_before_sealing_is_refused_by_version(key: bytes | None) -> None:
    """Version 2 with an HMAC carried a keyed job's body in the clear: refused, and the
    reason says what changed, whether or not this side holds the key."""
    old = hmac_v2([1, 2, 3, "rs", 0])
    assert reason_of(old, key) is FrameReason.BAD_VERSION
    with pytest.raises(FrameError, match="sealed"):
        decode(old, key)


def test_unknown_flags() -> None:
    assert reason_of(GOOD[:1] + b"\x05" + GOOD[2:]) is FrameReason.MALFORMED


def test_oversize() -> None:
    assert reason_of(GOOD + b"\x00" * 300_000) is FrameReason.OVERSIZE


@pytest.mark.parametrize(
    "kw", [{"job": "other"}, {"src": "agent-1"}, {"dsts": ("agent-1",)}], ids=str
)
def test_routed_elsewhere_is_unexpected(kw: dict[str, Any]) -> None:
    assert reason_of(GOOD, **kw) is FrameReason.UNEXPECTED


def test_broadcast_dst_is_accepted() -> None:
    data = encode_compact(decode(GOOD).replace(dst="*"), KEY)
    assert decode(data).dst == "*"


def test_bad_mac() -> None:
    assert reason_of(GOOD, b"other-key") is FrameReason.BAD_MAC  # does not open
    assert reason_of(GOOD_NO_KEY, KEY) is FrameReason.BAD_MAC  # no seal where one is due
    assert reason_of(GOOD, None) is FrameReason.BAD_MAC  # a seal where the job has no key


@pytest.mark.parametrize("where", ["prefix", "fields", "tag", "body"])
def test_any_changed_byte_fails_the_tag(where: str) -> None:
    cases = ((GOOD, KEY, FrameReason.BAD_MAC, SEAL_TAG_BYTES),
             (GOOD_NO_KEY, None, FrameReason.BAD_SHA256, TAG_BYTES))  # fmt: skip
    for data, key, reason, tag in cases:
        end = header_bytes(data) - tag  # sealed: header, body, tag; clear: header, tag, body
        tag_at, body_at = (len(data) - 5, end + 2) if key else (end + 2, len(data) - 5)
        at = {"prefix": 6, "fields": end - 3, "tag": tag_at, "body": body_at}[where]
        bad = bytearray(data)
        bad[at] ^= 0x01  # at "prefix": the fields' length, one off
        assert reason_of(bytes(bad), key) is reason


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({"seq": 1}, id="map"),
        pytest.param([1, 2, 3], id="short"),
        pytest.param([-1, 0, 0, "rs", 0], id="seq-negative"),
        pytest.param([True, 0, 0, "rs", 0], id="seq-bool"),
        pytest.param([0, 1.5, 0, "rs", 0], id="round-float"),
        pytest.param([0, 0, "1", "rs", 0], id="step-str"),
        pytest.param([0, 0, 0, b"rs", 0], id="phase-bin"),
        pytest.param([0, 0, 0, "p" * 129, 0], id="phase-long"),
        pytest.param([0, 0, 0, "rs"], id="no-mask"),
        pytest.param([0, 0, 0, "rs", 256], id="mask-unknown-bit"),
        pytest.param([0, 0, 0, "rs", 3, 0], id="mask-value-missing"),
        pytest.param([0, 0, 0, "rs", 1, 99], id="word-unknown"),
        pytest.param([0, 0, 0, "rs", 0, "x"], id="extra-key-alone"),
        pytest.param([0, 0, 0, "rs", 1, 0, "codec", 1], id="extra-key-known"),
        pytest.param([0, 0, 0, "rs", 0, 5, 1], id="extra-key-int"),
        pytest.param([0, 0, 0, "rs", 32, 7], id="arrays-not-list"),
        pytest.param([0, 0, 0, "rs", 32, [127, 1]], id="arrays-bad-code"),
        pytest.param([0, 0, 0, "rs", 32, [5]], id="arrays-same-first"),
        pytest.param([0, 0, 0, "rs", 32, [["idx"]]], id="arrays-bad-entry"),
    ],
)
def test_malformed_fields(fields: Any) -> None:
    assert reason_of(forge(fields)) is FrameReason.MALFORMED


def test_too_deep_and_trailing_fields() -> None:
    assert reason_of(forge([0, 0, 0, "rs", 0, "x", [[[[1]]]]])) is FrameReason.TOO_DEEP
    packed = msgpack.packb([0, 0, 0, "rs", 0]) + b"\x00"
    assert reason_of(forge_raw(packed)) is FrameReason.TRAILING_BYTES


@pytest.mark.parametrize(
    "part",
    [[1, 1, b"d" * 8], [2, 2, b"d" * 8], [0, 4097, b"d" * 8], [0, 2, b"d" * 7], [0, 2], [5, 6, 1]],
    ids=str,
)
def test_bad_part(part: list[Any]) -> None:
    assert reason_of(forge([3, 0, 0, "rs", *part, 0], flags=SPLIT)) is FrameReason.BAD_PART


def test_seq_below_its_part_index_is_refused() -> None:
    fields = [1, 0, 0, "rs", 3, 4, b"d" * 8, 0]
    assert reason_of(forge(fields, flags=SPLIT)) is FrameReason.BAD_PART


def test_encoder_refuses_what_it_cannot_say() -> None:
    with pytest.raises(ValueError, match="chunks"):
        encode_compact(Frame(kind="hello", job="j", src="a", dst="b", seq=0))
    frame = frame_of(GroupTopK(100, 5, "fp16").compress(_x(1000)), part=(1, 3))
    with pytest.raises(ValueError, match="msg"):
        encode_compact(frame)


# --------------------------------------------------------------------------- fuzz


def _mutants(rng: random.Random, data: bytes, others: list[bytes]) -> bytes:
    b = bytearray(data)
    roll = rng.randrange(5)
    if roll == 0:
        for _ in range(rng.choice((1, 2, 8))):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    elif roll == 1:
        b[rng.randrange(len(b))] = rng.randrange(256)
    elif roll == 2:
        del b[rng.randrange(len(b)) :]
    elif roll == 3:
        i = rng.randrange(len(b) + 1)
        b[i:i] = bytes(rng.randrange(256) for _ in range(rng.choice((1, 4, 16))))
    else:
        other = rng.choice(others)
        b = bytearray(data[: rng.randrange(len(data) + 1)] + other[rng.randrange(len(other)) :])
    return bytes(b)


@pytest.mark.slow
def test_byte_fuzz_refuses_every_mutant_with_a_frame_error() -> None:
    """Every changed byte is covered by the tag, keyed or not: all mutants are refused."""
    rng = random.Random(20261125)
    bases = [
        (encode_compact(frame_of(p), key), key)
        for p in ring_payloads(5210, 4)
        for key in (KEY, None)
    ]
    others = [d for d, _ in bases]
    reasons: dict[str, int] = {}
    for data, key in bases:
        for _ in range(800):
            mutant = _mutants(rng, data, others)
            if mutant == data:
                continue
            try:
                decode(mutant, key)
            except FrameError as exc:
                reasons[exc.reason.value] = reasons.get(exc.reason.value, 0) + 1
                continue
            pytest.fail(f"mutant accepted: {mutant.hex()}")
    assert {"bad_mac", "bad_sha256", "truncated", "bad_version", "unexpected"} <= set(reasons)
