"""Typed errors for everything that arrives from outside: frames and payloads.

A malformed frame never crashes an agent or the coordinator. Decoders raise
`FrameError` with a `FrameReason`; the receiving loop counts it by reason, logs
one line, drops the frame and keeps waiting.
"""

from __future__ import annotations

from enum import StrEnum


class FrameReason(StrEnum):
    """Why a frame (or the payload inside it) was refused."""

    TRUNCATED = "truncated"  # msgpack ended before the value did
    TRAILING_BYTES = "trailing_bytes"  # bytes after the top-level map
    OVERSIZE = "oversize"  # frame, string, binary or array beyond the limits
    TOO_DEEP = "too_deep"  # nesting beyond FrameLimits.max_depth
    NON_STRING_KEYS = "non_string_keys"  # a map key that is not a str
    MALFORMED = "malformed"  # not msgpack, not a map, ext types, bad field types
    BAD_VERSION = "bad_version"  # protocol version we do not speak
    BAD_KIND = "bad_kind"  # unknown frame kind
    MISSING_FIELD = "missing_field"
    UNKNOWN_FIELD = "unknown_field"
    BAD_SHA256 = "bad_sha256"  # body or reassembled payload does not match its digest
    BAD_MAC = "bad_mac"  # seal missing or unexpected, or it does not open (wrong key, altered)
    BAD_PART = "bad_part"  # part [i, n] inconsistent with its siblings
    UNKNOWN_CODEC = "unknown_codec"
    BAD_DTYPE = "bad_dtype"  # dtype outside the allow-list or not what the codec needs
    SHAPE_MISMATCH = "shape_mismatch"  # shapes disagree with the body, meta or manifest
    INDEX_OUT_OF_RANGE = "index_out_of_range"  # group-local index >= group size
    NON_FINITE = "non_finite"  # NaN or Inf in transmitted values
    UNEXPECTED = "unexpected"  # well-formed but not what this receiver awaits


class FrameError(ValueError):
    """A frame or payload that was refused; `reason` says why, `detail` says where."""

    def __init__(self, reason: FrameReason, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail
