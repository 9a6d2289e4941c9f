"""Compression: group-top-k, quantizers, error feedback, delta encoding, codecs.

Nothing here knows the network or frames; payloads describe themselves (meta and
named arrays), `registry` names their types by codec id, and a payload that does
not add up raises `PayloadError`. `fedring.collective.payloads` puts them in frame
bodies and takes them out.
"""

from fedring.compression.delta import DeltaEncoder
from fedring.compression.error_feedback import ErrorFeedback
from fedring.compression.group_topk import GroupTopK, k_for
from fedring.compression.payload import (
    Compressor,
    Payload,
    PayloadError,
    PayloadLimits,
    PayloadReason,
)
from fedring.compression.quantize import (
    DenseChunk,
    DenseCodec,
    Int8Groups,
    Int8Quantizer,
    SignBits,
    SignQuantizer,
)
from fedring.compression.registry import COMPRESSORS, PAYLOADS, make_compressor, payload_type
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
    "PayloadError",
    "PayloadLimits",
    "PayloadReason",
    "SignBits",
    "SignQuantizer",
    "SparseGroups",
    "k_for",
    "make_compressor",
    "payload_type",
]
