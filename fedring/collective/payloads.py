"""Payloads in frame bodies and back: where compression meets the wire.

`fedring.compression` knows payloads as meta plus named numpy arrays and knows no
frames; `fedring.wire` lays arrays end to end in a body and knows no codecs. This
module joins the two for every sender and receiver (`PeerChannel`, the benches):

    >>> import torch
    >>> from fedring.compression import GroupTopK, PayloadLimits
    >>> meta, body = encode_payload(GroupTopK(4, 1).compress(torch.tensor([1., -5, 2, 0])))
    >>> decode_payload(meta, bytearray(body), PayloadLimits()).decompress()
    tensor([ 0., -5.,  0.,  0.])

A payload that does not add up is refused by compression with a `PayloadError`;
here it becomes the `FrameError` with the same reason, so a receiving loop counts
and logs both kinds of refusal the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedring.compression.payload import Payload, PayloadError, PayloadLimits, PayloadReason
from fedring.compression.registry import payload_type
from fedring.wire.arrays import pack_arrays, unpack_arrays
from fedring.wire.errors import FrameError, FrameReason

# Every payload refusal is a frame refusal under the same name; a PayloadReason the
# wire lacks fails here, at import, rather than on the first bad payload.
FRAME_REASON: Mapping[PayloadReason, FrameReason] = {r: FrameReason(r.value) for r in PayloadReason}


def frame_error(exc: PayloadError) -> FrameError:
    """The `FrameError` a receiver counts for a refused payload: same reason, same detail."""
    return FrameError(FRAME_REASON[exc.reason], exc.detail)


def encode_payload(payload: Payload) -> tuple[dict[str, Any], bytes]:
    """A frame's meta (with the ``arrays`` spec) and body for `payload`."""
    meta, arrays = payload.to_wire()
    spec, body = pack_arrays(arrays)
    meta["arrays"] = spec
    return meta, body


def decode_payload(
    meta: Mapping[str, Any], body: bytes | bytearray, limits: PayloadLimits
) -> Payload:
    """Validate a frame's `meta` and `body` and build the payload they describe.

    Raises `FrameError` for anything refused. The codec is checked before the body
    is looked at, and array sizes against `limits` before anything is allocated.
    Pass a `bytearray` to get a payload over writable memory.
    """
    try:
        cls = payload_type(meta)
        arrays = unpack_arrays(meta.get("arrays"), body, max_elements=limits.max_elements)
        payload: Payload = cls.from_wire(meta, arrays, limits)
    except PayloadError as exc:
        raise frame_error(exc) from exc
    return payload
