"""Frames: round trips, and one refusal per `FrameReason` with the exact reason.

Malformed frames that `encode_frame` cannot produce are built by unpacking a good
frame into a plain dict, changing it, and packing it again with msgpack.
"""

from __future__ import annotations

import dataclasses
import random
import struct
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

from fedring.collective.channel import PeerChannel
from fedring.collective.payloads import decode_payload
from fedring.compression import GroupTopK, PayloadLimits
from fedring.compression.payload import Payload
from fedring.transport import Deadline, InprocTransport
from fedring.wire.arrays import pack_arrays
from fedring.wire.chunks import Reassembler, split_payload
from fedring.wire.compact import decode_compact, encode_compact, header_bytes
from fedring.wire.errors import FrameError, FrameReason
from fedring.wire.frame import Frame, FrameLimits, decode_frame, encode_frame
from fedring.wire.integrity import sha256

KEY = b"job-key"
LIMITS = PayloadLimits(max_numel=1 << 20)


# --------------------------------------------------------------------------- helpers


def sample_frame(**changes: Any) -> Frame:
    frame = Frame(
        kind="chunk",
        job="job-1",
        src="a0",
        dst="a1",
        seq=42,
        round=3,
        step=7,
        phase="reduce",
        part=(0, 1),
        meta={"codec": "dense", "note": "hi", "list": [1, 2, 3], "map": {"x": 1.5}},
        body=bytes(range(256)) * 4,
    )
    return frame.replace(**changes)


def raw_of(data: bytes) -> dict[str, Any]:
    """The msgpack map of an encoded frame, as a mutable dict."""
    raw = msgpack.unpackb(data, raw=False)
    assert isinstance(raw, dict)
    return raw


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def reject(data: bytes, key: bytes | None = None, limits: FrameLimits | None = None) -> FrameError:
    with pytest.raises(FrameError) as info:
        decode_frame(data, key, limits)
    return info.value


def assert_reason(
    data: bytes, reason: FrameReason, key: bytes | None = None, limits: FrameLimits | None = None
) -> None:
    err = reject(data, key, limits)
    assert err.reason is reason, str(err)


def compress(
    numel: int = 4000, group_size: int = 256, k: int = 8, value_dtype: str = "fp16", seed: int = 0
) -> Payload:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen)
    return GroupTopK(group_size, k, value_dtype).compress(x)  # type: ignore[arg-type]


def wire(payload: Payload) -> tuple[dict[str, Any], bytes]:
    """meta (with the array spec) and body, exactly as `PeerChannel.send` builds them."""
    meta, arrays = payload.to_wire()
    spec, body = pack_arrays(arrays)
    meta["arrays"] = spec
    return meta, body


def payload_frames(payload: Payload, limits: FrameLimits, first_seq: int = 0) -> list[Frame]:
    meta, body = wire(payload)
    template = Frame(
        kind="chunk", job="j", src="a0", dst="a1", seq=0, round=1, step=2, phase="reduce", meta=meta
    )
    return split_payload(template, body, first_seq, limits)


def reject_payload(meta: dict[str, Any], body: bytes | bytearray, reason: FrameReason) -> None:
    with pytest.raises(FrameError) as info:
        decode_payload(meta, bytearray(body), LIMITS)
    assert info.value.reason is reason, str(info.value)


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("key", [None, KEY], ids=["no-key", "key"])
def test_frame_round_trip(key: bytes | None) -> None:
    frame = sample_frame(part=(1, 3), meta={"codec": "x", "blob": b"\x00\xff", "l": [1, [2]]})
    decoded = decode_frame(encode_frame(frame, key), key)
    assert decoded == frame
    for f in dataclasses.fields(Frame):
        name = f.name
        assert getattr(decoded, name) == getattr(frame, name), name
    assert isinstance(decoded.part, tuple)


def test_frame_round_trip_defaults() -> None:
    frame = Frame(kind="bye", job="j", src="a", dst="*", seq=0)
    assert decode_frame(encode_frame(frame)) == frame


def test_a_keyed_frame_is_sealed_and_an_unkeyed_one_is_clear() -> None:
    clear = raw_of(encode_frame(sample_frame()))
    assert clear["v"] == 1 and clear["body"] == sample_frame().body and "mac" not in clear
    sealed = raw_of(encode_frame(sample_frame(), KEY))
    assert sealed["v"] == 3 and "mac" not in sealed and "sha256" not in sealed
    assert len(sealed["body"]) == len(sample_frame().body) + 16  # the tag
    assert sample_frame().body[:64] not in sealed["body"]


@pytest.mark.parametrize("key", [None, KEY], ids=["no-key", "key"])
def test_multi_part_round_trip(key: bytes | None) -> None:
    limits = FrameLimits(max_frame_bytes=8192)
    payload = compress(numel=60_000, group_size=256, k=16, value_dtype="fp32")
    _, body = wire(payload)
    assert len(body) > 3 * limits.max_body_bytes
    frames = payload_frames(payload, limits, first_seq=10)
    n = len(frames)
    assert n > 3
    assert [f.part for f in frames] == [(i, n) for i in range(n)]
    assert [f.seq for f in frames] == list(range(10, 10 + n))
    encoded = [encode_frame(f, key) for f in frames]
    assert all(len(e) <= limits.max_frame_bytes for e in encoded)
    random.Random(1).shuffle(encoded)  # parts may arrive in any order
    reasm = Reassembler(limits)
    results = [reasm.add(decode_frame(e, key, limits)) for e in encoded]
    assert all(r is None for r in results[:-1])
    done = results[-1]
    assert done is not None
    head, joined = done
    assert bytes(joined) == body
    assert head.seq == 10 and head.part == (0, n)
    assert head.meta["msg"] == 10 and head.meta["payload_sha256"] == sha256(body)
    assert list(reasm.pending()) == []
    decoded = decode_payload(head.meta, joined, LIMITS)
    assert torch.equal(decoded.decompress(), payload.decompress())


@pytest.mark.parametrize("value_dtype", ["fp32", "fp16", "bf16", "int8"])
@pytest.mark.parametrize("group_size", [100, 1024])
def test_group_topk_payload_round_trip(value_dtype: str, group_size: int) -> None:
    payload = compress(numel=5000, group_size=group_size, k=7, value_dtype=value_dtype)
    (frame,) = payload_frames(payload, FrameLimits())
    assert frame.part == (0, 1) and "payload_sha256" not in frame.meta
    decoded_frame = decode_frame(encode_frame(frame, KEY), KEY)
    done = Reassembler().add(decoded_frame)
    assert done is not None
    head, body = done
    decoded = decode_payload(head.meta, body, LIMITS)
    assert type(decoded) is type(payload)
    assert torch.equal(decoded.decompress(), payload.decompress())
    assert decoded.decompress().abs().sum() > 0


# --------------------------------------------------------------------------- envelope refusals


@pytest.mark.parametrize("cut", [0, 1, 10, 100, -33, -1])
def test_truncated(cut: int) -> None:
    data = encode_frame(sample_frame(), KEY)
    assert_reason(data[:cut], FrameReason.TRUNCATED, KEY)


@pytest.mark.parametrize("version", [2, 0, "1", 1.0, None])
def test_bad_version(version: Any) -> None:
    raw = raw_of(encode_frame(sample_frame()))
    raw["v"] = version
    assert_reason(pack(raw), FrameReason.BAD_VERSION)


def test_bad_sha256_body_flipped() -> None:
    raw = raw_of(encode_frame(sample_frame()))
    body = bytearray(raw["body"])
    body[17] ^= 0x01
    raw["body"] = bytes(body)
    assert_reason(pack(raw), FrameReason.BAD_SHA256)


@pytest.mark.parametrize("digest", [b"\x00" * 31, b"\x00" * 33, "a" * 32, 5])
def test_bad_sha256_field(digest: Any) -> None:
    raw = raw_of(encode_frame(sample_frame()))
    raw["sha256"] = digest
    assert_reason(pack(raw), FrameReason.BAD_SHA256)


def test_bad_sha256_multi_part_payload() -> None:
    limits = FrameLimits(max_frame_bytes=8192)
    frames = payload_frames(compress(numel=40_000, k=16, value_dtype="fp32"), limits)
    assert len(frames) > 1
    wrong = bytes(32)
    frames = [f.replace(meta={**f.meta, "payload_sha256": wrong}) for f in frames]
    reasm = Reassembler(limits)
    for f in frames[:-1]:
        assert reasm.add(decode_frame(encode_frame(f, KEY), KEY, limits)) is None
    last = decode_frame(encode_frame(frames[-1], KEY), KEY, limits)
    with pytest.raises(FrameError) as info:
        reasm.add(last)
    assert info.value.reason is FrameReason.BAD_SHA256
    assert list(reasm.pending()) == []


def test_bad_mac_wrong_key() -> None:
    assert_reason(encode_frame(sample_frame(), KEY), FrameReason.BAD_MAC, b"other-key")


def test_bad_mac_missing_when_key_expected() -> None:
    assert_reason(encode_frame(sample_frame()), FrameReason.BAD_MAC, KEY)


def test_bad_mac_present_without_key() -> None:
    assert_reason(encode_frame(sample_frame(), KEY), FrameReason.BAD_MAC, None)


@pytest.mark.parametrize(
    "field, value",
    [
        ("round", 4),
        ("seq", 43),
        ("src", "a9"),
        ("phase", "gather"),
        ("part", [0, 2]),
        ("meta", {"codec": "dense"}),
    ],
)
def test_bad_mac_header_tampered(field: str, value: Any) -> None:
    raw = raw_of(encode_frame(sample_frame(), KEY))
    raw[field] = value
    assert_reason(pack(raw), FrameReason.BAD_MAC, KEY)


@pytest.mark.parametrize("body", [b"forged", b"forged" + bytes(16), b""])
def test_bad_mac_sealed_body_swapped(body: bytes) -> None:
    raw = raw_of(encode_frame(sample_frame(), KEY))
    raw["body"] = body
    reason = FrameReason.TRUNCATED if len(body) < 16 else FrameReason.BAD_MAC
    assert_reason(pack(raw), reason, KEY)


@pytest.mark.parametrize("name, value", [("sha256", bytes(32)), ("mac", bytes(32))])
def test_a_digest_or_mac_in_a_sealed_frame_is_refused(name: str, value: bytes) -> None:
    raw = raw_of(encode_frame(sample_frame(), KEY))
    raw[name] = value
    assert_reason(pack(raw), FrameReason.UNKNOWN_FIELD, KEY)


@pytest.mark.parametrize("key", [KEY, None], ids=["key", "no-key"])
def test_a_frame_signed_as_before_sealing_is_refused_by_version(key: bytes | None) -> None:
    """Version 1 with an HMAC carried a keyed job's body in the clear."""
    raw = raw_of(encode_frame(sample_frame()))
    raw["mac"] = bytes(32)
    assert "sealed" in str(reject(pack(raw), key))
    assert_reason(pack(raw), FrameReason.BAD_VERSION, key)


@pytest.mark.parametrize("tag", [b"\x00" * 31, "x" * 32, None])
def test_bad_mac_malformed_tag(tag: Any) -> None:
    raw = raw_of(encode_frame(sample_frame()))
    raw["mac"] = tag
    assert_reason(pack(raw), FrameReason.BAD_MAC, KEY)


def test_oversize_frame() -> None:
    limits = FrameLimits()
    data = encode_frame(sample_frame(body=b"\x00" * limits.max_frame_bytes))
    assert len(data) > limits.max_frame_bytes
    assert_reason(data, FrameReason.OVERSIZE)
    small = FrameLimits(max_frame_bytes=8192)
    data = encode_frame(sample_frame(body=b"\x00" * 8192))
    assert_reason(data, FrameReason.OVERSIZE, limits=small)
    assert_reason(data[: small.max_frame_bytes + 1], FrameReason.OVERSIZE, limits=small)


@pytest.mark.parametrize(
    "meta",
    [
        {"note": "x" * 1025},  # str beyond max_str_len
        {"l": list(range(65))},  # array beyond max_array_len
        {f"k{i}": i for i in range(33)},  # map beyond max_map_len
    ],
    ids=["str", "array", "map"],
)
def test_oversize_container(meta: dict[str, Any]) -> None:
    assert_reason(encode_frame(sample_frame(meta=meta)), FrameReason.OVERSIZE)


def test_limits_at_the_bound_are_accepted() -> None:
    meta = {"note": "x" * 1024, "l": list(range(64))}
    frame = sample_frame(meta=meta)
    assert decode_frame(encode_frame(frame)) == frame


def test_oversize_part_body_in_reassembler() -> None:
    wide = FrameLimits(max_frame_bytes=64 * 1024)
    narrow = FrameLimits(max_frame_bytes=8192)
    frames = payload_frames(compress(numel=200_000, k=16, value_dtype="fp32"), wide)
    assert len(frames) > 1
    frame = decode_frame(encode_frame(frames[0]), None, wide)
    with pytest.raises(FrameError) as info:
        Reassembler(narrow).add(frame)
    assert info.value.reason is FrameReason.OVERSIZE


def test_too_deep_meta() -> None:
    # top-level map = 1, meta = 2, a = 3, b = 4, c = 5 > max_depth 4
    assert_reason(encode_frame(sample_frame(meta={"a": {"b": {"c": {}}}})), FrameReason.TOO_DEEP)
    assert_reason(encode_frame(sample_frame(meta={"a": [[[1]]]})), FrameReason.TOO_DEEP)
    ok = sample_frame(meta={"a": {"b": {"c": 1}}, "l": [[1]]})
    assert decode_frame(encode_frame(ok)) == ok


def test_too_deep_beyond_decoder_stack() -> None:
    assert_reason(b"\x91" * 5000 + b"\xc0", FrameReason.TOO_DEEP)


def test_too_deep_custom_limit() -> None:
    data = encode_frame(sample_frame(meta={"a": 1}))
    assert_reason(data, FrameReason.TOO_DEEP, limits=FrameLimits(max_depth=1))
    assert decode_frame(data, limits=FrameLimits(max_depth=2)).meta == {"a": 1}


def test_non_string_keys_int_at_top_level() -> None:
    raw: dict[Any, Any] = raw_of(encode_frame(sample_frame()))
    raw[1] = "x"
    assert_reason(pack(raw), FrameReason.NON_STRING_KEYS)


def test_non_string_keys_bytes_inside_meta() -> None:
    raw = raw_of(encode_frame(sample_frame()))
    raw["meta"] = {"codec": "dense", b"k": 1}
    assert_reason(pack(raw), FrameReason.NON_STRING_KEYS)


def test_non_string_keys_int_inside_meta() -> None:
    raw = raw_of(encode_frame(sample_frame()))
    raw["meta"] = {"nested": {7: "x"}}
    assert_reason(pack(raw), FrameReason.NON_STRING_KEYS)


def test_non_string_keys_bytes_in_list_in_meta() -> None:
    raw = raw_of(encode_frame(sample_frame()))
    raw["meta"] = {"l": [{b"k": 1}]}
    assert_reason(pack(raw), FrameReason.NON_STRING_KEYS)


@pytest.mark.parametrize("extra", [b"\x00", b"\xc0", b"\x80", b"\x00" * 100])
def test_trailing_bytes(extra: bytes) -> None:
    assert_reason(encode_frame(sample_frame(), KEY) + extra, FrameReason.TRAILING_BYTES, KEY)


def test_trailing_frame() -> None:
    data = encode_frame(sample_frame(), KEY)
    assert_reason(data + data, FrameReason.TRAILING_BYTES, KEY)


def _with(field: str, value: Any) -> bytes:
    raw = raw_of(encode_frame(sample_frame()))
    raw[field] = value
    return pack(raw)


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(pack([1, 2, 3]), id="top-list"),
        pytest.param(pack("frame"), id="top-str"),
        pytest.param(pack(None), id="top-nil"),
        pytest.param(pack(b"\x00" * 8), id="top-bin"),
        pytest.param(pack({"meta": {"x": msgpack.ExtType(5, b"abc")}}), id="ext-in-partial-map"),
        pytest.param(_with("meta", {"x": msgpack.ExtType(1, b"abcd")}), id="ext-in-meta"),
        pytest.param(_with("meta", {"when": msgpack.Timestamp(1, 0)}), id="timestamp-ext"),
        pytest.param(_with("round", msgpack.ExtType(2, b"\x01")), id="ext-as-round"),
        pytest.param(b"\xc1", id="never-used-byte"),
        pytest.param(b"\x81\xa1t\xa2\xff\xfe", id="bad-utf8"),
        pytest.param(_with("meta", [1, 2]), id="meta-list"),
        pytest.param(_with("meta", "codec"), id="meta-str"),
        pytest.param(_with("body", "text"), id="body-str"),
        pytest.param(_with("body", None), id="body-nil"),
        pytest.param(_with("job", 5), id="job-int"),
        pytest.param(_with("job", ""), id="job-empty"),
        pytest.param(_with("src", "s" * 129), id="src-long"),
        pytest.param(_with("dst", b"a1"), id="dst-bin"),
        pytest.param(_with("phase", 0), id="phase-int"),
        pytest.param(_with("seq", -1), id="seq-negative"),
        pytest.param(_with("seq", 2**64 - 1), id="seq-huge"),
        pytest.param(_with("seq", True), id="seq-bool"),
        pytest.param(_with("round", 1.0), id="round-float"),
        pytest.param(_with("step", "7"), id="step-str"),
    ],
)
def test_malformed(data: bytes) -> None:
    assert_reason(data, FrameReason.MALFORMED)


@pytest.mark.parametrize("field", ["meta", "meta-nested"])
def test_malformed_zero_length_ext(field: str) -> None:
    ext = msgpack.ExtType(1, b"")
    meta = {"x": ext} if field == "meta" else {"l": [1, ext]}
    assert_reason(_with("meta", meta), FrameReason.MALFORMED)


@pytest.mark.parametrize("field", ["v", "t", "job", "src", "dst", "seq", "body", "sha256"])
def test_missing_field(field: str) -> None:
    raw = raw_of(encode_frame(sample_frame()))
    del raw[field]
    assert_reason(pack(raw), FrameReason.MISSING_FIELD)


@pytest.mark.parametrize("field", ["extra", "V", "kind", ""])
def test_unknown_field(field: str) -> None:
    raw = raw_of(encode_frame(sample_frame()))
    raw[field] = 1
    assert_reason(pack(raw), FrameReason.UNKNOWN_FIELD)


@pytest.mark.parametrize("kind", ["chunky", "", "CHUNK", b"chunk", 3, None])
def test_bad_kind(kind: Any) -> None:
    assert_reason(_with("t", kind), FrameReason.BAD_KIND)


@pytest.mark.parametrize("kind", [[], ["chunk"], {}], ids=["empty-list", "list", "map"])
def test_bad_kind_unhashable(kind: Any) -> None:
    err = reject(_with("t", kind))
    assert err.reason in (FrameReason.BAD_KIND, FrameReason.MALFORMED)


@pytest.mark.parametrize(
    "part",
    [
        [2, 2],
        [3, 2],
        [0, 0],
        [-1, 2],
        [0],
        [0, 1, 2],
        [0, 4097],
        [0, "1"],
        [0.0, 1],
        [True, 2],
        "0/1",
        None,
    ],
)
def test_bad_part(part: Any) -> None:
    assert_reason(_with("part", part), FrameReason.BAD_PART)


def test_part_at_max_parts_accepted() -> None:
    frame = sample_frame(part=(4095, 4096))
    assert decode_frame(encode_frame(frame)) == frame


def test_bad_part_in_reassembler() -> None:
    limits = FrameLimits(max_frame_bytes=8192)
    frames = payload_frames(compress(numel=40_000, k=16, value_dtype="fp32"), limits, first_seq=5)
    assert len(frames) > 2
    meta_no_digest = {k: v for k, v in frames[1].meta.items() if k != "payload_sha256"}
    cases = [
        frames[1].replace(meta=meta_no_digest),  # multi-part without payload_sha256
        frames[1].replace(seq=frames[1].seq + 1),  # seq != msg + i
        frames[0].replace(meta={**frames[0].meta, "payload_sha256": b"short"}),
    ]
    for frame in cases:
        with pytest.raises(FrameError) as info:
            Reassembler(limits).add(frame)
        assert info.value.reason is FrameReason.BAD_PART
    # a sibling disagreeing with the first part (other round) drops the message
    reasm = Reassembler(limits)
    assert reasm.add(frames[0]) is None
    with pytest.raises(FrameError) as info:
        reasm.add(frames[1].replace(round=frames[1].round + 1))
    assert info.value.reason is FrameReason.BAD_PART
    assert list(reasm.pending()) == []


# --------------------------------------------------------------------------- payload refusals


def test_unknown_codec_through_decode_payload() -> None:
    meta, body = wire(compress())
    frame = Frame(
        kind="chunk", job="j", src="a0", dst="a1", seq=0, meta={**meta, "codec": "zstd"}, body=body
    )
    decoded = decode_frame(encode_frame(frame, KEY), KEY)  # the envelope is fine
    with pytest.raises(FrameError) as info:
        decode_payload(decoded.meta, bytearray(decoded.body), LIMITS)
    assert info.value.reason is FrameReason.UNKNOWN_CODEC


@pytest.mark.parametrize("codec", [None, 7, b"group-topk", "GROUP-TOPK"])
def test_unknown_codec_values(codec: Any) -> None:
    meta, body = wire(compress())
    if codec is None:
        del meta["codec"]
    else:
        meta["codec"] = codec
    reject_payload(meta, body, FrameReason.UNKNOWN_CODEC)


@pytest.mark.parametrize("dtype", ["f8", "c8", "i8", "u4", "float32", "", 4, None])
def test_bad_dtype_not_allowed(dtype: Any) -> None:
    meta, body = wire(compress(value_dtype="fp32"))
    meta["arrays"]["val"][0] = dtype
    reject_payload(meta, body, FrameReason.BAD_DTYPE)


def test_bad_dtype_wrong_for_codec() -> None:
    # "i4" is on the wire allow-list and matches the byte count, but group-topk
    # values are never int32.
    meta, body = wire(compress(value_dtype="fp32"))
    meta["arrays"]["val"][0] = "i4"
    reject_payload(meta, body, FrameReason.BAD_DTYPE)
    meta, body = wire(compress(group_size=100))
    meta["arrays"]["idx"][0] = "i1"  # idx of G <= 256 must be u1
    reject_payload(meta, body, FrameReason.BAD_DTYPE)


def test_shape_mismatch_spec_larger_than_body() -> None:
    meta, body = wire(compress())
    meta["arrays"]["val"][1] += 1
    reject_payload(meta, body, FrameReason.SHAPE_MISMATCH)
    meta, body = wire(compress())
    reject_payload(meta, body[:-1], FrameReason.SHAPE_MISMATCH)
    reject_payload(meta, body + b"\x00\x00\x00\x00", FrameReason.SHAPE_MISMATCH)


def test_shape_mismatch_through_decoded_frame() -> None:
    meta, body = wire(compress())
    meta["arrays"]["val"] = ["f2", 100, 100]
    frame = decode_frame(encode_frame(Frame("chunk", "j", "a", "b", 0, meta=meta, body=body)))
    with pytest.raises(FrameError) as info:
        decode_payload(frame.meta, bytearray(frame.body), LIMITS)
    assert info.value.reason is FrameReason.SHAPE_MISMATCH


@pytest.mark.parametrize(
    "change",
    [
        {"k": 9},  # idx and val are [n, 8]
        {"k": 7},
        {"groups": [0, 15]},  # payload covers 16 groups
        {"groups": [1, 16]},
        {"group_size": 4000},  # one group only, but groups [0, 16]
        {"numel": 10},
    ],
    ids=lambda c: str(c),
)
def test_shape_mismatch_sparse_meta_disagrees_with_idx(change: dict[str, Any]) -> None:
    meta, body = wire(compress(numel=4000, group_size=256, k=8))
    assert meta["groups"] == [0, 16] and meta["k"] == 8
    meta.update(change)
    reject_payload(meta, body, FrameReason.SHAPE_MISMATCH)


def test_shape_mismatch_idx_shape_in_spec() -> None:
    # spec and body agree with each other (same byte count) but not with meta k/groups
    meta, body = wire(compress(numel=4000, group_size=256, k=8))
    n, k = meta["arrays"]["idx"][1:]
    meta["arrays"]["idx"] = ["u1", k, n]
    reject_payload(meta, body, FrameReason.SHAPE_MISMATCH)
    meta, body = wire(compress(numel=4000, group_size=256, k=8))
    meta["arrays"]["idx"] = ["u1", n * k]
    reject_payload(meta, body, FrameReason.SHAPE_MISMATCH)


def test_shape_mismatch_missing_and_extra_arrays() -> None:
    meta, body = wire(compress(value_dtype="fp32"))
    idx_bytes = int(np.prod(meta["arrays"]["idx"][1:]))
    spec = meta["arrays"]
    meta["arrays"] = {"idx": spec["idx"]}
    reject_payload(meta, body[:idx_bytes], FrameReason.SHAPE_MISMATCH)  # "val" missing
    meta["arrays"] = {**spec, "extra": ["u1", 4]}
    reject_payload(meta, body + b"\x00" * 4, FrameReason.SHAPE_MISMATCH)


@pytest.mark.parametrize("position", [0, 3, -1])
def test_index_out_of_range(position: int) -> None:
    payload = compress(numel=1000, group_size=100, k=5)
    meta, body = wire(payload)
    assert meta["arrays"]["idx"] == ["u1", 10, 5]  # G <= 256: uint8 indices, first in body
    idx_bytes = 10 * 5
    buf = bytearray(body)
    buf[position % idx_bytes] = 150
    reject_payload(meta, buf, FrameReason.INDEX_OUT_OF_RANGE)
    buf[position % idx_bytes] = 100  # == G is out of range too
    reject_payload(meta, buf, FrameReason.INDEX_OUT_OF_RANGE)
    buf[position % idx_bytes] = 99
    decode_payload(meta, buf, LIMITS).decompress()


def test_index_out_of_range_uint16() -> None:
    meta, body = wire(compress(numel=5000, group_size=1000, k=4))
    assert meta["arrays"]["idx"][0] == "u2"
    buf = bytearray(body)
    buf[0:2] = struct.pack("<H", 1000)
    reject_payload(meta, buf, FrameReason.INDEX_OUT_OF_RANGE)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_fp32_values(bad: float) -> None:
    payload = compress(numel=1000, group_size=100, k=5, value_dtype="fp32")
    meta, body = wire(payload)
    val_offset = 52  # 50 index bytes, padded to a 4-byte boundary
    assert meta["arrays"]["val"] == ["f4", 10, 5]
    assert len(body) == val_offset + 50 * 4
    buf = bytearray(body)
    buf[val_offset + 8 : val_offset + 12] = struct.pack("<f", bad)
    reject_payload(meta, buf, FrameReason.NON_FINITE)


def test_non_finite_fp16_value_and_int8_scale() -> None:
    meta, body = wire(compress(numel=1000, group_size=100, k=5, value_dtype="fp16"))
    buf = bytearray(body)
    buf[52:54] = np.float16("nan").tobytes()
    reject_payload(meta, buf, FrameReason.NON_FINITE)
    meta, body = wire(compress(numel=1000, group_size=100, k=5, value_dtype="int8"))
    assert list(meta["arrays"]) == ["idx", "val", "scale"]
    buf = bytearray(body)
    buf[-4:] = struct.pack("<f", float("inf"))
    reject_payload(meta, buf, FrameReason.NON_FINITE)


def test_oversize_array_beyond_max_numel() -> None:
    meta, body = wire(compress())
    with pytest.raises(FrameError) as info:
        decode_payload(meta, bytearray(body), PayloadLimits(max_numel=16))
    assert info.value.reason in (FrameReason.OVERSIZE, FrameReason.SHAPE_MISMATCH)
    meta["arrays"]["val"] = ["f2", 1 << 10, 1 << 11]
    reject_payload(meta, body, FrameReason.OVERSIZE)


# --------------------------------------------------------------------------- the channel


def _pair(key: bytes = b"k") -> tuple[Any, PeerChannel, PeerChannel]:
    hub = InprocTransport()
    sender_ep = hub.connect("a")
    receiver_ep = hub.connect("b")
    sender = PeerChannel(sender_ep, "j", key)
    receiver = PeerChannel(receiver_ep, "j", key)
    return sender_ep, sender, receiver


def _good_frame_bytes(seq: int, step: int, key: bytes) -> tuple[bytes, Payload]:
    payload = compress(numel=2000, seed=step)
    meta, body = wire(payload)
    frame = Frame(
        kind="chunk",
        job="j",
        src="a",
        dst="b",
        seq=seq,
        round=0,
        step=step,
        phase="reduce",
        meta=meta,
        body=body,
    )
    return encode_compact(frame, key), payload


_GOOD = _good_frame_bytes(900, 0, b"k")[0]
_TRUNCATED = _GOOD[: header_bytes(_GOOD) - 1]
_WRONG_KEY = _good_frame_bytes(901, 0, b"wrong")[0]
_VERSION_1 = encode_frame(decode_compact(_GOOD, job="j", src="a", dsts=("b",), key=b"k"), b"k")
_OTHER_JOB = encode_compact(
    decode_compact(_GOOD, job="j", src="a", dsts=("b",), key=b"k").replace(job="j2"), b"k"
)


@pytest.mark.parametrize(
    "garbage, reason",
    [
        (b"\x93\x01\x02\x03", "bad_version"),
        (b"\xc1 not msgpack at all", "bad_version"),
        (_VERSION_1, "bad_version"),
        (_TRUNCATED, "truncated"),
        (_WRONG_KEY, "bad_mac"),
        (_OTHER_JOB, "unexpected"),
        (_GOOD[:7] + b"\x00" + _GOOD[8:], "bad_mac"),
    ],
    ids=["list", "text", "version-1", "truncated", "wrong-key", "other-job", "header-byte"],
)
def test_channel_counts_refused_frame(garbage: bytes, reason: str) -> None:
    sender_ep, sender, receiver = _pair()
    sender_ep.send("b", garbage, Deadline.after(1))
    payload = compress(numel=3000, seed=3)
    sender.send("b", payload, round=0, step=0, phase="reduce", deadline=Deadline.after(1))
    got = receiver.recv("a", round=0, step=0, phase="reduce", deadline=Deadline.after(5))
    assert torch.equal(got.decompress(), payload.decompress())
    assert receiver.counters.get(f"frame_{reason}") == 1
    refused = {k: v for k, v in receiver.counters.snapshot().items() if k.startswith("frame_")}
    assert refused == {f"frame_{reason}": 1}


def test_channel_counts_refused_multi_part_payload() -> None:
    hub = InprocTransport()
    sender_ep, receiver_ep = hub.connect("a"), hub.connect("b")
    limits = FrameLimits(max_frame_bytes=8192)
    sender = PeerChannel(sender_ep, "j", b"k", limits=limits)
    receiver = PeerChannel(receiver_ep, "j", b"k", limits=limits)
    payload = compress(numel=40_000, k=16, value_dtype="fp32")
    frames = payload_frames(payload, limits, first_seq=1000)
    frames = [
        f.replace(src="a", dst="b", job="j", step=9, meta={**f.meta, "payload_sha256": bytes(32)})
        for f in frames
    ]
    for f in frames:
        sender_ep.send("b", encode_compact(f, b"k"), Deadline.after(1))
    sender.send("b", payload, round=1, step=2, phase="reduce", deadline=Deadline.after(1))
    got = receiver.recv("a", round=1, step=2, phase="reduce", deadline=Deadline.after(5))
    assert torch.equal(got.decompress(), payload.decompress())
    assert receiver.counters.get("frame_bad_sha256") == 1


def test_channel_counts_duplicate() -> None:
    sender_ep, sender, receiver = _pair()
    data, first = _good_frame_bytes(1000, 0, b"k")
    sender_ep.send("b", data, Deadline.after(1))
    sender_ep.send("b", data, Deadline.after(1))  # at-least-once redelivery
    second = compress(numel=3000, seed=5)
    sender.send("b", second, round=0, step=1, phase="reduce", deadline=Deadline.after(1))
    got = receiver.recv("a", round=0, step=0, phase="reduce", deadline=Deadline.after(5))
    assert torch.equal(got.decompress(), first.decompress())
    got = receiver.recv("a", round=0, step=1, phase="reduce", deadline=Deadline.after(5))
    assert torch.equal(got.decompress(), second.decompress())
    assert receiver.counters.get("duplicate") == 1
    assert not any(k.startswith("frame_") for k in receiver.counters.snapshot())


def test_limits_that_cannot_hold_a_header_are_refused() -> None:
    with pytest.raises(ValueError, match="max_frame_bytes=1024"):
        FrameLimits(max_frame_bytes=1024)
    with pytest.raises(ValueError, match="max_depth=0"):
        FrameLimits(max_depth=0)


def test_reassembler_refuses_more_parts_than_a_payload_may_need() -> None:
    limits = FrameLimits(max_frame_bytes=8192)
    parts = Reassembler(limits, max_payload_bytes=10 * limits.max_body_bytes)
    frames = split_payload(sample_frame(), b"\x01" * (11 * limits.max_body_bytes), 0, limits)
    with pytest.raises(FrameError) as info:
        parts.add(frames[0])
    assert info.value.reason is FrameReason.OVERSIZE


def test_reassembler_holds_a_bounded_number_of_bytes() -> None:
    limits = FrameLimits(max_frame_bytes=8192)
    cap = 8 * limits.max_body_bytes
    parts = Reassembler(limits, max_pending_bytes=cap)
    for msg in range(50):  # 50 payloads of 4 parts, each missing its last part
        frames = split_payload(
            sample_frame(), bytes([msg]) * (4 * limits.max_body_bytes), msg * 10, limits
        )
        for f in frames[:3]:
            assert parts.add(f.replace(src=f"s{msg}")) is None
        assert parts.held_bytes <= cap
    frames = split_payload(sample_frame(), b"\x07" * (4 * limits.max_body_bytes), 1000, limits)
    done = [parts.add(f) for f in frames]
    assert done[-1] is not None and bytes(done[-1][1]) == b"\x07" * (4 * limits.max_body_bytes)
