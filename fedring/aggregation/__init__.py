"""Aggregation rules: how updates from many agents become one."""

from fedring.aggregation.rules import (
    Aggregation,
    aligned,
    capped_weights,
    centred_clip,
    hybrid,
    mean,
    median,
    robust,
    sign_vote,
    trimmed_mean,
    weighted,
)

__all__ = [
    "Aggregation",
    "aligned",
    "capped_weights",
    "centred_clip",
    "hybrid",
    "mean",
    "median",
    "robust",
    "sign_vote",
    "trimmed_mean",
    "weighted",
]
