"""Payloads without frames: meta and named arrays in, a payload or a `PayloadError` out."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fedring.compression import (
    GroupTopK,
    Payload,
    PayloadError,
    PayloadLimits,
    PayloadReason,
    payload_type,
)
from fedring.compression.payload import Decoded


def _arrays(payload: Payload) -> tuple[dict[str, Any], Decoded]:
    """What a receiver would unpack from the body, without a body."""
    meta, arrays = payload.to_wire()
    return meta, {name: (dtype, a.copy()) for name, dtype, a in arrays}


def test_meta_and_arrays_round_trip() -> None:
    sent = GroupTopK(100, 5, "int8").compress(torch.randn(1000))
    meta, arrays = _arrays(sent)
    back = payload_type(meta).from_wire(meta, arrays, PayloadLimits())
    assert torch.equal(back.decompress(), sent.decompress())


@pytest.mark.parametrize("codec", [None, "zstd", 7])
def test_unknown_codec_is_a_payload_error(codec: Any) -> None:
    with pytest.raises(PayloadError) as info:
        payload_type({"codec": codec})
    assert info.value.reason is PayloadReason.UNKNOWN_CODEC
    assert isinstance(info.value, ValueError)


def test_index_out_of_range_is_a_payload_error() -> None:
    meta, arrays = _arrays(GroupTopK(100, 5).compress(torch.randn(1000)))
    arrays["idx"][1][0, 0] = 100  # == G
    with pytest.raises(PayloadError) as info:
        payload_type(meta).from_wire(meta, arrays, PayloadLimits())
    assert info.value.reason is PayloadReason.INDEX_OUT_OF_RANGE
    assert str(info.value) == "index_out_of_range: index 100 >= group size 100"


def test_limits_bound_the_elements_an_array_may_declare() -> None:
    limits = PayloadLimits(max_numel=1000, max_group_size=256)
    assert limits.max_elements == 1256  # k of the padded last group may pass numel
