"""fedring payloads inside Flower messages: frames in, the same payload out, or a typed refusal."""

from __future__ import annotations

import pytest
import torch

from fedring.compression import GroupTopK
from fedring.compression.quantize import DenseCodec
from fedring.flower import carrier
from fedring.wire.frame import FrameLimits


def test_round_trip_is_bit_exact() -> None:
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(1))
    sent = GroupTopK(256, 3, "fp16").compress(x)
    frames = carrier.pack(sent, src="node-1", dst="server", round=4, phase="up")
    got = carrier.unpack(frames, src="node-1", dst="server", round=4, phase="up", numel=10_000)
    assert torch.equal(got.decompress(), sent.decompress())


def test_large_payload_is_split_and_rejoined() -> None:
    x = torch.randn(200_000, generator=torch.Generator().manual_seed(2))
    frames = carrier.pack(
        DenseCodec("fp32").compress(x), src="server", dst="*", round=0, phase="params"
    )
    assert len(frames) > 1  # 800 kB of fp32 in frames of at most 256 KiB
    assert all(len(f) <= FrameLimits().max_frame_bytes for f in frames)
    got = carrier.unpack(frames, src="server", dst="node-0", round=0, phase="params", numel=200_000)
    assert torch.equal(got.decompress(), x)


def test_tampered_frame_is_refused_with_the_reason() -> None:
    sent = GroupTopK(4, 1).compress(torch.tensor([1.0, -5, 2, 0]))
    frame = bytearray(carrier.pack(sent, src="node-0", dst="server", round=1, phase="up")[0])
    frame[-3] ^= 0xFF  # inside the body: its sha256 no longer matches
    with pytest.raises(carrier.CarrierError, match="frame_"):
        carrier.unpack([bytes(frame)], src="node-0", dst="server", round=1, phase="up", numel=4)


def test_wrong_position_or_size_is_refused() -> None:
    sent = GroupTopK(4, 1).compress(torch.tensor([1.0, -5, 2, 0]))
    frames = carrier.pack(sent, src="node-0", dst="server", round=1, phase="up")
    with pytest.raises(carrier.CarrierError, match="round 2"):
        carrier.unpack(frames, src="node-0", dst="server", round=2, phase="up", numel=4)
    with pytest.raises(carrier.CarrierError):  # claims more entries than the receiver holds
        carrier.unpack(frames, src="node-0", dst="server", round=1, phase="up", numel=3)
    with pytest.raises(carrier.CarrierError, match="numel 4, not 8"):
        carrier.unpack(frames, src="node-0", dst="server", round=1, phase="up", numel=8)
