"""Frames on the wire: msgpack envelope, compact payload frames, seals, parts, arrays."""

from fedring.wire.arrays import DTYPES, pack_arrays, unpack_arrays
from fedring.wire.chunks import Reassembler, SeenWindow, split_payload
from fedring.wire.compact import COMPACT_VERSION, decode_compact, encode_compact
from fedring.wire.errors import FrameError, FrameReason
from fedring.wire.frame import (
    KINDS,
    PROTOCOL_VERSION,
    Frame,
    FrameLimits,
    decode_frame,
    encode_frame,
)
from fedring.wire.seal import SEALED_VERSION

__all__ = [
    "COMPACT_VERSION",
    "DTYPES",
    "KINDS",
    "PROTOCOL_VERSION",
    "SEALED_VERSION",
    "Frame",
    "FrameError",
    "FrameLimits",
    "FrameReason",
    "Reassembler",
    "SeenWindow",
    "decode_compact",
    "decode_frame",
    "encode_compact",
    "encode_frame",
    "pack_arrays",
    "split_payload",
    "unpack_arrays",
]
