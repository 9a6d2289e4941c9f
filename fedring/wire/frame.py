"""The frame: one msgpack map per message, decoded with strict bounds.

Every message between agents and the coordinator is a `Frame`. On the wire it is a
msgpack map with string keys and no extension types (see ARCHITECTURE.md, "Wire
frames"). `decode_frame` checks size, depth, lengths, field types and the body's
sha256 before anything else looks at it; every refusal is a `FrameError` with a
`FrameReason`.

A keyed job's frames are sealed (version 3, `fedring.wire.seal`): the same map
without the ``sha256`` and ``mac`` fields, whose ``body`` is the body encrypted
and followed by a 16-byte tag over the canonical header and the body. Only an
unkeyed job's frames (and the enrolment manifest that hands the key out) travel
in the clear, as version 1.

Run `python -m fedring.wire.frame` to print an encoded example.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

from fedring.wire.errors import FrameError, FrameReason
from fedring.wire.integrity import DIGEST_BYTES, sha256
from fedring.wire.seal import SEALED_VERSION, open_sealed, seal

PROTOCOL_VERSION = 1  # in the clear; a keyed job's frames are SEALED_VERSION
KINDS = frozenset({"hello", "manifest", "chunk", "model", "shard", "metrics", "ack", "nack", "bye"})
_REQUIRED = ("v", "t", "job", "src", "dst", "seq", "body")  # and, in the clear, "sha256"
_OPTIONAL = ("round", "step", "phase", "part", "meta", "mac")
_KNOWN = frozenset((*_REQUIRED, "sha256", *_OPTIONAL))
_MAX_ID_LEN = 128  # job, src, dst and phase strings
_MAX_COUNTER = 2**63 - 1


@dataclass(frozen=True)
class FrameLimits:
    """Bounds enforced while decoding, before any allocation that depends on input."""

    max_frame_bytes: int = 256 * 1024  # whole encoded frame; below EMQX's 1 MB packet cap
    max_depth: int = 4  # the top-level map counts as 1
    max_str_len: int = 1024
    max_array_len: int = 64
    max_map_len: int = 32
    max_parts: int = 4096  # a payload split over more frames than this is refused

    def __post_init__(self) -> None:
        if self.max_frame_bytes < 8192:
            raise ValueError(
                f"max_frame_bytes={self.max_frame_bytes} must be >= 8192 (4 KiB of header room "
                "plus at least 4 KiB of body)"
            )
        for name in ("max_depth", "max_str_len", "max_array_len", "max_map_len", "max_parts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")

    @property
    def max_body_bytes(self) -> int:
        """Room for the body once a generous header allowance is taken off."""
        return self.max_frame_bytes - 4096


@dataclass(frozen=True)
class Frame:
    """One message. `meta` holds small scalars, lists and maps; `body` the bytes."""

    kind: str
    job: str
    src: str
    dst: str
    seq: int
    round: int = 0
    step: int = 0
    phase: str = ""
    part: tuple[int, int] = (0, 1)
    meta: Mapping[str, Any] = field(default_factory=dict)
    body: bytes = b""

    def replace(self, **changes: Any) -> Frame:
        return dataclasses.replace(self, **changes)


def _header(frame: Frame, digest: bytes | None) -> dict[str, Any]:
    # The canonical header: a sealed frame's tag covers exactly these bytes, rebuilt
    # from the validated Frame on both sides, so encoder quirks cannot matter.
    header = {
        "v": PROTOCOL_VERSION if digest is not None else SEALED_VERSION,
        "t": frame.kind,
        "job": frame.job,
        "round": frame.round,
        "step": frame.step,
        "phase": frame.phase,
        "src": frame.src,
        "dst": frame.dst,
        "seq": frame.seq,
        "part": list(frame.part),
        "meta": dict(frame.meta),
    }
    if digest is not None:
        header["sha256"] = digest
    return header


def encode_frame(frame: Frame, key: bytes | None = None) -> bytes:
    """Encode `frame`; with `key` (a keyed job), its body sealed under the header."""
    if key is None:
        wire = {**_header(frame, sha256(frame.body)), "body": frame.body}
        return msgpack.packb(wire, use_bin_type=True)
    header = _header(frame, None)
    ad = msgpack.packb(header, use_bin_type=True)
    return msgpack.packb({**header, "body": seal(key, ad, frame.body)}, use_bin_type=True)


def decode_frame(data: bytes, key: bytes | None = None, limits: FrameLimits | None = None) -> Frame:
    """Decode and verify one frame; raise `FrameError` on anything off."""
    limits = limits or FrameLimits()
    if len(data) > limits.max_frame_bytes:
        raise FrameError(
            FrameReason.OVERSIZE, f"frame of {len(data)} bytes > {limits.max_frame_bytes}"
        )
    if data[:1] in (b"\x02", b"\x03"):  # see `fedring.wire.compact`
        raise FrameError(
            FrameReason.BAD_VERSION,
            f"v={data[0]} (a compact frame), this side speaks {PROTOCOL_VERSION} and "
            f"{SEALED_VERSION}",
        )
    raw = unpack_bounded(data, limits)
    check_shape(raw, limits.max_depth)
    frame, digest, tag = _fields(raw, limits)
    what = f"frame seq={frame.seq} from {frame.src!r}"
    if digest is None:  # sealed
        if key is None:
            raise FrameError(FrameReason.BAD_MAC, f"{what} is sealed but this job has no key")
        ad = msgpack.packb(_header(frame, None), use_bin_type=True)
        return frame.replace(body=open_sealed(key, ad, frame.body, what))
    if sha256(frame.body) != digest:
        raise FrameError(FrameReason.BAD_SHA256, f"body of {what}")
    _check_clear(what, tag, key)
    return frame


def unpack_bounded(data: bytes | memoryview, limits: FrameLimits) -> Any:
    """One msgpack value within `limits`, no extension types; `FrameError` otherwise."""
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_ext_len=0,  # extension types are never allowed...
            ext_hook=_refuse_ext,  # ...not even zero-length ones, which max_ext_len lets by
            max_bin_len=limits.max_frame_bytes,
            max_str_len=limits.max_str_len,
            max_array_len=limits.max_array_len,
            max_map_len=limits.max_map_len,
        )
    except FrameError:
        raise
    except msgpack.ExtraData as exc:
        raise FrameError(FrameReason.TRAILING_BYTES, "bytes after the frame map") from exc
    except msgpack.StackError as exc:
        raise FrameError(FrameReason.TOO_DEEP, "nesting beyond the decoder's stack") from exc
    except UnicodeDecodeError as exc:
        raise FrameError(FrameReason.MALFORMED, "a string is not valid UTF-8") from exc
    except ValueError as exc:
        raise FrameError(_reason_for(str(exc)), str(exc)) from exc
    except Exception as exc:  # msgpack's C decoder may raise TypeError on odd input
        raise FrameError(FrameReason.MALFORMED, f"{type(exc).__name__}: {exc}") from exc


def _refuse_ext(code: int, data: bytes) -> Any:
    raise FrameError(FrameReason.MALFORMED, f"extension type {code} is not allowed")


def _reason_for(message: str) -> FrameReason:
    if "incomplete input" in message:
        return FrameReason.TRUNCATED
    if "map key" in message:
        return FrameReason.NON_STRING_KEYS
    if "max_ext_len" in message:
        return FrameReason.MALFORMED
    if "exceeds max_" in message:
        return FrameReason.OVERSIZE
    return FrameReason.MALFORMED


def check_shape(value: Any, max_depth: int) -> None:
    """Refuse non-str keys anywhere and nesting deeper than `max_depth`."""
    if not isinstance(value, dict):
        raise FrameError(FrameReason.MALFORMED, f"top level is {type(value).__name__}, not a map")
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            raise FrameError(FrameReason.TOO_DEEP, f"nesting depth {depth} > {max_depth}")
        if isinstance(node, dict):
            for k, v in node.items():
                if not isinstance(k, str):
                    raise FrameError(
                        FrameReason.NON_STRING_KEYS, f"map key of type {type(k).__name__}"
                    )
                if isinstance(v, (dict, list)):
                    stack.append((v, depth + 1))
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node if isinstance(v, (dict, list)))


def _fields(raw: dict[str, Any], limits: FrameLimits) -> tuple[Frame, bytes | None, bytes | None]:
    """The frame (its body as on the wire), its digest (None: sealed) and its MAC."""
    unknown = set(raw) - _KNOWN
    if unknown:
        raise FrameError(FrameReason.UNKNOWN_FIELD, f"unknown field {sorted(unknown)[0]!r}")
    missing = [k for k in _REQUIRED if k not in raw]
    if missing:
        raise FrameError(FrameReason.MISSING_FIELD, f"field {missing[0]!r} is missing")
    version = raw["v"]
    if type(version) is not int or version not in (PROTOCOL_VERSION, SEALED_VERSION):
        raise FrameError(
            FrameReason.BAD_VERSION,
            f"v={version!r}, this side speaks {PROTOCOL_VERSION} and {SEALED_VERSION}",
        )
    if not isinstance(raw["t"], str) or raw["t"] not in KINDS:
        raise FrameError(FrameReason.BAD_KIND, f"t={raw['t']!r}")
    digest = tag = None
    if version == SEALED_VERSION:
        if "sha256" in raw or "mac" in raw:  # the seal's tag covers the body and header
            name = "sha256" if "sha256" in raw else "mac"
            raise FrameError(FrameReason.UNKNOWN_FIELD, f"field {name!r} in a sealed frame")
    elif "sha256" not in raw:
        raise FrameError(FrameReason.MISSING_FIELD, "field 'sha256' is missing")
    else:
        digest = _bytes(raw, "sha256", DIGEST_BYTES)
        tag = _bytes(raw, "mac", DIGEST_BYTES) if "mac" in raw else None
    part = raw.get("part", [0, 1])
    if not (
        isinstance(part, list)
        and len(part) == 2
        and all(type(p) is int for p in part)
        and 0 <= part[0] < part[1] <= limits.max_parts
    ):
        raise FrameError(FrameReason.BAD_PART, f"part={part!r}")
    meta = raw.get("meta", {})
    if not isinstance(meta, dict):
        raise FrameError(FrameReason.MALFORMED, f"field 'meta' is {type(meta).__name__}, not a map")
    body = raw["body"]
    if not isinstance(body, bytes):
        raise FrameError(FrameReason.MALFORMED, f"field 'body' is {type(body).__name__}, not bytes")
    frame = Frame(
        kind=raw["t"],
        job=_ident(raw, "job"),
        src=_ident(raw, "src"),
        dst=_ident(raw, "dst"),
        seq=_counter(raw, "seq"),
        round=_counter(raw, "round"),
        step=_counter(raw, "step"),
        phase=_ident(raw, "phase", allow_empty=True),
        part=(part[0], part[1]),
        meta=meta,
        body=body,
    )
    return frame, digest, tag


def _ident(raw: dict[str, Any], name: str, allow_empty: bool = False) -> str:
    value = raw.get(name, "")
    if not isinstance(value, str) or len(value) > _MAX_ID_LEN or (not value and not allow_empty):
        raise FrameError(
            FrameReason.MALFORMED, f"field {name!r}={value!r:.60} is not a short string"
        )
    return value


def _counter(raw: dict[str, Any], name: str) -> int:
    value = raw.get(name, 0)
    if type(value) is not int or not 0 <= value <= _MAX_COUNTER:
        raise FrameError(FrameReason.MALFORMED, f"field {name!r}={value!r:.60} is not a counter")
    return value


def _bytes(raw: dict[str, Any], name: str, size: int) -> bytes:
    value = raw[name]
    if not isinstance(value, bytes) or len(value) != size:
        reason = FrameReason.BAD_MAC if name == "mac" else FrameReason.BAD_SHA256
        raise FrameError(reason, f"field {name!r} is not {size} bytes")
    return value


def _check_clear(what: str, tag: bytes | None, key: bytes | None) -> None:
    """A frame in the clear is taken only where the job has no key."""
    if tag is not None:  # signed with an HMAC, as keyed frames were before sealing
        raise FrameError(
            FrameReason.BAD_VERSION,
            f"{what} is signed with an HMAC (v={PROTOCOL_VERSION}): a keyed job's frames "
            f"are sealed (v={SEALED_VERSION})",
        )
    if key is not None:
        raise FrameError(FrameReason.BAD_MAC, f"{what} is not sealed but this job has a key")


if __name__ == "__main__":
    example = Frame(kind="chunk", job="demo", src="a0", dst="a1", seq=7, body=b"\x00" * 8)
    print(encode_frame(example, key=b"k").hex())
