"""Frames on the wire: msgpack envelope, integrity, parts, and array bodies."""

from fedring.wire.arrays import DTYPES, pack_arrays, unpack_arrays
from fedring.wire.chunks import Reassembler, SeenWindow, split_payload
from fedring.wire.errors import FrameError, FrameReason
from fedring.wire.frame import (
    KINDS,
    PROTOCOL_VERSION,
    Frame,
    FrameLimits,
    decode_frame,
    encode_frame,
)

__all__ = [
    "DTYPES",
    "KINDS",
    "PROTOCOL_VERSION",
    "Frame",
    "FrameError",
    "FrameLimits",
    "FrameReason",
    "Reassembler",
    "SeenWindow",
    "decode_frame",
    "encode_frame",
    "pack_arrays",
    "split_payload",
    "unpack_arrays",
]
