"""Where compression meets the wire: a refused payload is the same refused frame."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from fedring.collective.payloads import FRAME_REASON, decode_payload, encode_payload
from fedring.compression import GroupTopK, PayloadError, PayloadLimits, PayloadReason
from fedring.wire.errors import FrameError, FrameReason


def test_every_payload_reason_is_the_frame_reason_of_the_same_name() -> None:
    assert set(FRAME_REASON) == set(PayloadReason)
    for reason, frame_reason in FRAME_REASON.items():
        assert frame_reason.value == reason.value and frame_reason.name == reason.name


def test_round_trip_through_a_body() -> None:
    sent = GroupTopK(64, 3, "bf16").compress(torch.randn(500))
    meta, body = encode_payload(sent)
    assert set(meta["arrays"]) == {"idx", "val"}
    back = decode_payload(meta, bytearray(body), PayloadLimits(max_numel=500))
    assert torch.equal(back.decompress(), sent.decompress())


@pytest.mark.parametrize(
    ("spoil", "reason"),
    [
        (lambda meta, body: meta.update(codec="zstd"), FrameReason.UNKNOWN_CODEC),
        (lambda meta, body: meta.update(k=6), FrameReason.SHAPE_MISMATCH),
        (lambda meta, body: body.__setitem__(0, 100), FrameReason.INDEX_OUT_OF_RANGE),
    ],
    ids=["codec", "meta", "index"],
)
def test_a_refused_payload_becomes_a_frame_error_with_its_reason_and_detail(
    spoil: Callable[[dict[str, Any], bytearray], None], reason: FrameReason
) -> None:
    meta, data = encode_payload(GroupTopK(100, 5).compress(torch.randn(1000)))
    body = bytearray(data)
    spoil(meta, body)
    with pytest.raises(FrameError) as info:
        decode_payload(meta, body, PayloadLimits())
    err = info.value
    assert err.reason is reason
    assert isinstance(err.__cause__, PayloadError)
    assert str(err) == str(err.__cause__) and err.detail == err.__cause__.detail


def test_codec_is_checked_before_the_body() -> None:
    meta, body = encode_payload(GroupTopK(100, 5).compress(torch.randn(1000)))
    meta["codec"], meta["arrays"] = "zstd", "not a spec"
    with pytest.raises(FrameError) as info:
        decode_payload(meta, body, PayloadLimits())
    assert info.value.reason is FrameReason.UNKNOWN_CODEC
