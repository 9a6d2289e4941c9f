"""Codecs by id: which payload type a meta's ``codec`` names, and how a compressor
named in a job is built.

The table is checked when this module is imported: ids are unique, every payload
type has the full `Payload` interface, and every compressor produces a payload
type that is registered. A meta naming any other codec is refused with
`PayloadReason.UNKNOWN_CODEC`. Bytes to arrays is the framing layer's step
(`fedring.collective.payloads.decode_payload`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from fedring.compression.group_topk import GroupTopK
from fedring.compression.model_patch import ModelPatch
from fedring.compression.payload import Compressor, PayloadError, PayloadReason
from fedring.compression.quantize import (
    DenseChunk,
    DenseCodec,
    Int8Groups,
    Int8Quantizer,
    SignBits,
    SignQuantizer,
)
from fedring.compression.sparse import GroupSparse, SparseGroups
from fedring.compression.support import GroupIndices

_PAYLOAD_TYPES: tuple[type[Any], ...] = (
    DenseChunk,
    Int8Groups,
    SignBits,
    SparseGroups,
    GroupSparse,
    GroupIndices,
    ModelPatch,
)
PAYLOADS: Mapping[str, type[Any]] = {cls.codec_id: cls for cls in _PAYLOAD_TYPES}

COMPRESSORS: Mapping[str, Callable[..., Compressor]] = {
    "none": lambda **kw: DenseCodec("fp32"),
    "fp16": lambda **kw: DenseCodec("fp16"),
    "bf16": lambda **kw: DenseCodec("bf16"),
    "int8": lambda group_size=256, **kw: Int8Quantizer(group_size),
    "sign": lambda group_size=4096, **kw: SignQuantizer(group_size),
    "group-topk": lambda density=0.01, group_size=256, value_dtype="fp16", **kw: (
        GroupTopK.from_density(density, group_size, value_dtype)
    ),
}


def make_compressor(name: str, **options: Any) -> Compressor:
    """Build the compressor called `name` (``none``, ``fp16``, ``group-topk``, ...)."""
    if name not in COMPRESSORS:
        raise ValueError(f"compression {name!r} is not one of {', '.join(COMPRESSORS)}")
    return COMPRESSORS[name](**options)


def payload_type(meta: Mapping[str, Any]) -> type[Any]:
    """The payload type whose `from_wire` builds what `meta` describes."""
    codec = meta.get("codec")
    cls = PAYLOADS.get(codec) if isinstance(codec, str) else None
    if cls is None:
        raise PayloadError(PayloadReason.UNKNOWN_CODEC, f"codec {codec!r:.40}")
    return cls


def _check() -> None:
    members = ("add_to", "decompress", "to_wire", "from_wire", "wire_nbytes")
    for codec_id, cls in PAYLOADS.items():
        missing = [m for m in members if not hasattr(cls, m)]
        if missing or cls.codec_id != codec_id:
            raise TypeError(f"payload codec {codec_id!r} is incomplete: missing {missing}")
    if len(PAYLOADS) != len(_PAYLOAD_TYPES):
        raise TypeError("two payload types share a codec id")
    for name, make in COMPRESSORS.items():
        produced = make().codec_id
        if produced not in PAYLOADS:
            raise TypeError(f"compressor {name!r} produces unregistered codec {produced!r}")


_check()
