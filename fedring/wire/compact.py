"""Compact frames: every payload frame a `PeerChannel` sends.

A sparse ring chunk of the MNIST-1D CNN carries about 30 bytes of payload; the
version-1 envelope (`fedring.wire.frame`: a msgpack map with string keys, a 32-byte
sha256 and a 32-byte HMAC) cost about 260 more. A compact frame says the same in
a header of at most 64 bytes for single-part frames of the ring's codecs. Version 2
is an unkeyed job's (in the clear, with a digest); version 3 a keyed job's (its body
sealed, `fedring.wire.seal`):

    byte 0       version            2 clear, 3 sealed (a version-1 frame starts
                                    with a msgpack map byte)
    byte 1       flags              bit 1: one part of a split payload; bit 0 was
                                    "the tag is an HMAC" (keyed version 2, refused)
    bytes 2-5    route              sha256(context)[:4], context = (job, src, dst)
    byte 6       n                  length of the fields
    n bytes      fields             one msgpack array: seq, round, step, phase,
                                    [part index, part count, 8-byte payload digest,]
                                    a mask of the meta keys of KEYS present, their
                                    values in KEYS order, then other meta as key, value
    version 2:
    12 bytes     tag                sha256(context | header | body)[:12]
    the rest     body
    version 3:
    the rest     sealed body        AES-256-GCM-SIV(body), then its 16-byte tag; the
                                    associated data is context | header

Job, sender and receiver names are not on the wire: every transport names the
sender, and the receiver knows its job and its own name. They are bound by the
route (so a frame for another job or endpoint is told apart from a damaged one
and refused as `unexpected`) and by the tag, which covers them in full. Meta keys
and the strings of the payload meta (codec ids, array names, dtypes) travel as
bits and one-byte codes from the tables below (an array whose dims repeat the
previous array's is its code alone); anything outside the tables travels as
itself, so they only decide size, never what can be said. The header stays in the
clear when sealed: a reader outside the job learns sizes, counters and shapes,
never a value. A clear frame's digest is truncated to 96 bits: a damaged frame
passes with probability 2^-96.

A part of a split payload (more than `FrameLimits.max_body_bytes` of body) adds
its index, count and an 8-byte digest of the joined payload (about 13 bytes);
the payload's integrity rests on every part's own tag, and this digest catches
parts of two different payloads joined under one message id. (Sealed, that
digest lets a reader confirm a guess of a whole payload, never learn one.)

Control messages (hello, manifest, model, ...) stay msgpack maps (`wire.frame`).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import msgpack

from fedring.wire.errors import FrameError, FrameReason
from fedring.wire.frame import Frame, FrameLimits, check_shape, unpack_bounded
from fedring.wire.seal import SEAL_TAG_BYTES, SEALED_VERSION, open_sealed, seal

COMPACT_VERSION = 2  # in the clear: an unkeyed job's frames
TAG_BYTES = 12  # a clear frame's digest
PART_DIGEST_BYTES = 8
KEYED, SPLIT = 0x01, 0x02  # KEYED: a version-2 frame with an HMAC, from before sealing
_PREFIX = struct.Struct("<BB4sB")  # version, flags, route, fields length
_V1_FIRST = frozenset({*range(0x80, 0x90), 0xDE, 0xDF})  # msgpack map headers
_MAX_COUNTER = 2**63 - 1
_MAX_PHASE = 128

# Meta keys by bit of the key mask. Append only: a bit, once given, names its key for good.
KEYS = ("codec", "numel", "group_size", "k", "groups", "arrays", "range", "vdtype")
# Keys whose values are words (codec ids, dtype names), coded from WORDS.
_WORD_KEYS = frozenset({"codec", "vdtype"})
WORDS = ("group-topk", "group-sparse", "dense", "int8", "sign", "fp32", "fp16", "bf16")
# Array names and dtypes: an array's (name, dtype) is one byte, name * 16 + dtype.
ARRAY_NAMES = ("idx", "val", "scale", "count", "q", "pos", "nz")
ARRAY_DTYPES = ("u1", "u2", "i1", "i2", "i4", "f2", "bf16", "f4")
_KEY_CODE = {k: i for i, k in enumerate(KEYS)}
_WORD_CODE = {w: i for i, w in enumerate(WORDS)}
_NAME_CODE = {n: i for i, n in enumerate(ARRAY_NAMES)}
_DTYPE_CODE = {d: i for i, d in enumerate(ARRAY_DTYPES)}


@lru_cache(maxsize=4096)
def context(job: str, src: str, dst: str) -> tuple[bytes, bytes]:
    """The bytes every tag covers for (job, src, dst), and the 4-byte route."""
    parts = [s.encode() for s in (job, src, dst)]
    ctx = b"".join(struct.pack("<H", len(p)) + p for p in parts)
    return ctx, hashlib.sha256(ctx).digest()[:4]


def _tag(ctx: bytes, head: bytes | memoryview, body: bytes | memoryview) -> bytes:
    h = hashlib.sha256(ctx)
    h.update(head)
    h.update(body)
    return h.digest()[:TAG_BYTES]


# --------------------------------------------------------------------------- encode


def encode_compact(frame: Frame, key: bytes | None = None) -> bytes:
    """Encode a ``chunk`` frame compactly; with `key` (a keyed job), its body sealed."""
    if frame.kind != "chunk":
        raise ValueError(f"compact frames carry chunks, not {frame.kind!r}")
    meta = dict(frame.meta)
    fields: list[Any] = [frame.seq, frame.round, frame.step, frame.phase]
    flags = 0
    i, n = frame.part
    if n > 1:
        flags |= SPLIT
        msg, digest = meta.pop("msg", None), meta.pop("payload_sha256", None)
        if msg != frame.seq - i or not isinstance(digest, bytes):
            raise ValueError(f"part {i}/{n} of seq {frame.seq}: msg {msg!r} or digest missing")
        fields += [i, n, digest[:PART_DIGEST_BYTES]]
    known = [k for k in KEYS if k in meta]
    fields.append(sum(1 << _KEY_CODE[k] for k in known))
    fields += [_encode_value(k, meta[k]) for k in known]
    for name, value in meta.items():
        if name not in _KEY_CODE:
            fields += [name, value]
    packed = msgpack.packb(fields, use_bin_type=True)
    if len(packed) > 255:
        raise ValueError(f"compact header fields of {len(packed)} bytes > 255")
    ctx, route = context(frame.job, frame.src, frame.dst)
    version = COMPACT_VERSION if key is None else SEALED_VERSION
    head = _PREFIX.pack(version, flags, route, len(packed)) + packed
    if key is not None:
        return head + seal(key, ctx + head, frame.body)
    return b"".join((head, _tag(ctx, head, frame.body), frame.body))


def _encode_value(name: str, value: Any) -> Any:
    if name in _WORD_KEYS and isinstance(value, str):
        return _WORD_CODE.get(value, value)
    if name == "arrays" and isinstance(value, Mapping):
        out: list[Any] = []
        dims: list[Any] | None = None
        for n, spec in value.items():
            if not isinstance(spec, list) or not spec:  # nonsense: let the receiver refuse it
                out.append([n, spec])
                continue
            out.append(_encode_array(n, spec[0], spec[1:], same=spec[1:] == dims))
            dims = spec[1:]
        return out
    return value


def _encode_array(name: str, dtype: Any, dims: list[Any], same: bool) -> Any:
    """One array's spec: a bare code when its dims are the previous array's."""
    if name in _NAME_CODE and isinstance(dtype, str) and dtype in _DTYPE_CODE:
        code = _NAME_CODE[name] * 16 + _DTYPE_CODE[dtype]
        return code if same else [code, *dims]
    return [name, dtype, *dims]


def header_bytes(data: bytes) -> int:
    """Bytes of an encoded compact frame that are not its body: header and tag."""
    tag = SEAL_TAG_BYTES if data[0] == SEALED_VERSION else TAG_BYTES
    return _PREFIX.size + data[_PREFIX.size - 1] + tag


# --------------------------------------------------------------------------- decode


def decode_compact(
    data: bytes,
    *,
    job: str,
    src: str,
    dsts: tuple[str, ...],
    key: bytes | None = None,
    limits: FrameLimits | None = None,
) -> Frame:
    """Decode and verify (or open) a compact frame that `src` sent to one of `dsts` in `job`.

    Raises `FrameError`: a frame routed to another job, sender or receiver is
    ``unexpected``; a sealed frame that does not open under `key`, a clear frame
    where the job has a key and a sealed one where it has none are ``bad_mac``; a
    clear frame whose digest is wrong is ``bad_sha256``; a version-2 frame signed
    with an HMAC (before sealing) is ``bad_version``.
    """
    limits = limits or FrameLimits()
    if len(data) > limits.max_frame_bytes:
        raise FrameError(
            FrameReason.OVERSIZE, f"frame of {len(data)} bytes > {limits.max_frame_bytes}"
        )
    if not data:
        raise FrameError(FrameReason.TRUNCATED, "an empty frame")
    version = data[0]
    if version not in (COMPACT_VERSION, SEALED_VERSION):
        old = " (a version-1 msgpack frame)" if version in _V1_FIRST else ""
        raise FrameError(
            FrameReason.BAD_VERSION,
            f"v={version}{old}, this side speaks {COMPACT_VERSION} and {SEALED_VERSION}",
        )
    if len(data) < _PREFIX.size:
        raise FrameError(FrameReason.TRUNCATED, f"frame of {len(data)} bytes has no header")
    _, flags, route, n = _PREFIX.unpack_from(data)
    sealed = version == SEALED_VERSION
    if flags & KEYED and not sealed:
        raise FrameError(
            FrameReason.BAD_VERSION,
            f"a version-2 frame from {src!r} signed with an HMAC: a keyed job's frames are "
            f"sealed (version {SEALED_VERSION})",
        )
    if flags & ~SPLIT:
        raise FrameError(FrameReason.MALFORMED, f"field 'flags'={flags:#04x} has unknown bits")
    end = _PREFIX.size + n
    if len(data) < end + (SEAL_TAG_BYTES if sealed else TAG_BYTES):
        raise FrameError(FrameReason.TRUNCATED, f"frame of {len(data)} bytes, header needs more")
    dst = _route(route, job, src, dsts)
    if (key is not None) != sealed:
        has = "is sealed but this job has no key" if key is None else "is not sealed"
        raise FrameError(FrameReason.BAD_MAC, f"frame from {src!r} {has}")
    view = memoryview(data)
    ctx, _ = context(job, src, dst)
    if key is not None:
        body = open_sealed(key, ctx + data[:end], view[end:], f"frame from {src!r}")
    elif hmac.compare_digest(_tag(ctx, view[:end], view[end + TAG_BYTES :]),
                             view[end : end + TAG_BYTES]):  # fmt: skip
        body = data[end + TAG_BYTES :]
    else:
        raise FrameError(FrameReason.BAD_SHA256, f"tag of a frame from {src!r} does not match")
    fields = unpack_bounded(view[_PREFIX.size : end], limits)
    if not isinstance(fields, list) or len(fields) < 4:
        raise FrameError(FrameReason.MALFORMED, "fields are not an array of at least 4")
    check_shape({"meta": fields}, limits.max_depth)
    return _frame(fields, bool(flags & SPLIT), job, src, dst, body, limits)


def _route(route: bytes, job: str, src: str, dsts: tuple[str, ...]) -> str:
    for dst in dsts:
        if context(job, src, dst)[1] == route:
            return dst
    raise FrameError(
        FrameReason.UNEXPECTED, f"frame from {src!r} is routed to another job or receiver"
    )


def _frame(
    fields: list[Any], split: bool, job: str, src: str, dst: str, body: bytes,
    limits: FrameLimits,
) -> Frame:  # fmt: skip
    seq, round, step = (
        _counter(fields[i], name) for i, name in enumerate(("seq", "round", "step"))
    )
    phase = fields[3]
    if not isinstance(phase, str) or len(phase) > _MAX_PHASE:
        raise FrameError(
            FrameReason.MALFORMED, f"field 'phase'={phase!r:.60} is not a short string"
        )
    rest, part, meta = fields[4:], (0, 1), {}
    if split:
        if len(rest) < 3:
            raise FrameError(FrameReason.BAD_PART, "a split frame lacks its part fields")
        i, n, digest, rest = rest[0], rest[1], rest[2], rest[3:]
        if not (type(i) is int and type(n) is int and 0 <= i < n <= limits.max_parts and n > 1):
            raise FrameError(FrameReason.BAD_PART, f"part=[{i!r:.20}, {n!r:.20}]")
        if not isinstance(digest, bytes) or len(digest) != PART_DIGEST_BYTES:
            raise FrameError(FrameReason.BAD_PART, "payload digest is not 8 bytes")
        part, meta = (i, n), {"msg": seq - i, "payload_sha256": digest}
        if seq < i:
            raise FrameError(FrameReason.BAD_PART, f"part {i} has seq {seq}")
    mask = rest[0] if rest else None
    if type(mask) is not int or not 0 <= mask < 1 << len(KEYS):
        raise FrameError(FrameReason.MALFORMED, f"meta key mask {mask!r:.20} is not valid")
    known = [k for i, k in enumerate(KEYS) if mask >> i & 1]
    values, extra = rest[1 : 1 + len(known)], rest[1 + len(known) :]
    if len(values) < len(known) or len(extra) % 2:
        raise FrameError(FrameReason.MALFORMED, "meta has a key without a value")
    for name, value in zip(known, values, strict=True):
        meta[name] = _decode_value(name, value)
    for name, value in zip(extra[::2], extra[1::2], strict=True):
        if not isinstance(name, str) or not name or name in meta or name in _KEY_CODE:
            raise FrameError(FrameReason.MALFORMED, f"meta key {name!r:.40} is not valid here")
        meta[name] = value
    return Frame(kind="chunk", job=job, src=src, dst=dst, seq=seq, round=round, step=step,
                 phase=phase, part=part, meta=meta, body=body)  # fmt: skip


def _counter(value: Any, name: str) -> int:
    if type(value) is not int or not 0 <= value <= _MAX_COUNTER:
        raise FrameError(FrameReason.MALFORMED, f"field {name!r}={value!r:.60} is not a counter")
    return value


def _decode_value(name: str, value: Any) -> Any:
    if name in _WORD_KEYS and type(value) is int:
        if not 0 <= value < len(WORDS):
            raise FrameError(FrameReason.MALFORMED, f"meta {name!r}: word code {value} unknown")
        return WORDS[value]
    if name == "arrays":
        if not isinstance(value, list):
            raise FrameError(FrameReason.MALFORMED, "meta 'arrays' is not an array")
        spec: dict[str, list[Any]] = {}
        dims: list[Any] | None = None
        for entry in value:
            name, dtype, dims = _decode_array(entry, dims)
            spec[name] = [dtype, *dims]
        return spec
    return value


def _decode_array(entry: Any, previous: list[Any] | None) -> tuple[str, str, list[Any]]:
    if type(entry) is int and previous is not None:  # same dims as the previous array
        code, dims = entry, previous
    elif isinstance(entry, list) and entry and type(entry[0]) is int:
        code, dims = entry[0], entry[1:]
    elif isinstance(entry, list) and len(entry) >= 2 and isinstance(entry[0], str):
        return entry[0], entry[1], entry[2:]
    else:
        code, dims = -1, []
    name, dtype = divmod(code, 16) if code >= 0 else (-1, -1)
    if not (0 <= name < len(ARRAY_NAMES) and dtype < len(ARRAY_DTYPES)):
        raise FrameError(FrameReason.MALFORMED, f"meta 'arrays' entry {entry!r:.40} is not a spec")
    return ARRAY_NAMES[name], ARRAY_DTYPES[dtype], dims
