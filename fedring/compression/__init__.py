"""Compression: group-top-k, quantizers, error feedback, delta encoding, codecs.

Nothing here knows the network; payloads describe themselves and `registry`
decodes them from a frame's meta and body.
"""

from fedring.compression.delta import DeltaEncoder
from fedring.compression.error_feedback import ErrorFeedback
from fedring.compression.group_topk import GroupTopK, k_for
from fedring.compression.payload import Compressor, Payload, PayloadLimits
from fedring.compression.quantize import (
    DenseChunk,
    DenseCodec,
    Int8Groups,
    Int8Quantizer,
    SignBits,
    SignQuantizer,
)
from fedring.compression.registry import COMPRESSORS, PAYLOADS, decode_payload, make_compressor
from fedring.compression.schedule import DensitySchedule
from fedring.compression.sparse import GroupSparse, SparseGroups

__all__ = [
    "COMPRESSORS",
    "PAYLOADS",
    "Compressor",
    "DeltaEncoder",
    "DenseChunk",
    "DenseCodec",
    "DensitySchedule",
    "ErrorFeedback",
    "GroupSparse",
    "GroupTopK",
    "Int8Groups",
    "Int8Quantizer",
    "Payload",
    "PayloadLimits",
    "SignBits",
    "SignQuantizer",
    "SparseGroups",
    "decode_payload",
    "k_for",
    "make_compressor",
]
