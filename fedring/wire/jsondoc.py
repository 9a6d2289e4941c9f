"""Bounded JSON documents: the one way bytes from the network become a JSON object.

Control documents (hello, manifest, ack, metrics, bye), presence and the rendezvous
peek are JSON. `json.loads` recurses once per nested array or object and raises
`RecursionError` near depth 1000, which a receiving loop that expects `ValueError`
does not catch: one hostile message would end the process (issue 27). So
`parse_document` checks, in this order and before `json.loads` runs:

1. size: at most `max_bytes`;
2. encoding: strict UTF-8 (`json.loads` would also guess UTF-16 and UTF-32);
3. depth: brackets outside strings, counted by `nesting_depth` in linear time;

then parses, refusing integers beyond 64 bits (``float()`` of one raises
`OverflowError` wherever a figure is read) and any top level but an object. Every
refusal is a `FrameError` with a `FrameReason`, which receivers count and log.

    >>> parse_document(b'{"epoch": 0}')
    {'epoch': 0}
    >>> parse_document(b"[" * 5000)
    Traceback (most recent call last):
    ...
    fedring.wire.errors.FrameError: too_deep: document nests 5000 deep, more than 32
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from fedring.wire.errors import FrameError, FrameReason

MAX_DOC_BYTES = 1 << 20  # the largest manifest (spec, shard entry, task) is a few KiB
MAX_DOC_DEPTH = 32  # the top-level object counts as 1; a job's spec nests about 4 deep
_INT_RANGE = (-(2**63), 2**64 - 1)  # what a frame's counters and byte counts may hold
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_STEP = np.zeros(256, dtype=np.int8)  # +1 opens a container, -1 closes one
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1


def parse_document(
    data: bytes | bytearray | memoryview,
    *,
    max_bytes: int = MAX_DOC_BYTES,
    max_depth: int = MAX_DOC_DEPTH,
    what: str = "document",
) -> dict[str, Any]:
    """The JSON object in `data`, or a `FrameError` that says why not (`what` names it)."""
    raw = bytes(data)
    if len(raw) > max_bytes:
        raise FrameError(FrameReason.OVERSIZE, f"{what} of {len(raw)} bytes > {max_bytes}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FrameError(FrameReason.MALFORMED, f"{what} is not UTF-8: {exc}") from None
    # depth <= the opening brackets: a round's row (one object) skips the scan
    depth = nesting_depth(raw) if raw.count(b"[") + raw.count(b"{") > max_depth else 0
    if depth > max_depth:
        raise FrameError(FrameReason.TOO_DEEP, f"{what} nests {depth} deep, more than {max_depth}")
    try:
        doc = json.loads(text, parse_int=_bounded_int)
    except FrameError:
        raise
    except (ValueError, RecursionError) as exc:  # RecursionError: only if the scan were wrong
        raise FrameError(FrameReason.MALFORMED, f"{what} is not JSON: {exc}") from None
    except Exception as exc:  # nothing from the network may end a process
        raise FrameError(FrameReason.MALFORMED, f"{what}: {type(exc).__name__}: {exc}") from None
    if not isinstance(doc, dict):
        raise FrameError(FrameReason.MALFORMED, f"{what} is a {type(doc).__name__}, not an object")
    return doc


def nesting_depth(data: bytes) -> int:
    """How deep the arrays and objects in the JSON text `data` nest (0: a scalar).

    Brackets inside strings do not count. A quote delimits a string unless an odd
    run of backslashes precedes it: exact for valid JSON, and for invalid JSON up to
    the first error, where `json.loads` stops (its recursion follows the same
    prefix). Vectorised, so a hostile megabyte of quotes or backslashes costs
    milliseconds, not a Python loop per byte.
    """
    a = np.frombuffer(data, dtype=np.uint8)
    if a.size == 0:
        return 0
    at = np.arange(a.size, dtype=np.intp)
    plain = np.maximum.accumulate(np.where(a == _BACKSLASH, -1, at))  # last non-backslash
    run = np.zeros(a.size, dtype=np.intp)  # backslashes just before each byte
    run[1:] = at[:-1] - plain[:-1]
    delimiter = (a == _QUOTE) & (run % 2 == 0)
    in_string = np.cumsum(delimiter, dtype=np.intp) % 2 == 1  # the opening quote included
    steps = _STEP[a].astype(np.intp)
    steps[in_string] = 0
    return max(0, int(np.cumsum(steps).max()))


def _bounded_int(digits: str) -> int:
    if len(digits) > 21:  # before int(): 4,300 digits and more raise, fewer cost time
        raise FrameError(FrameReason.MALFORMED, f"integer of {len(digits)} digits")
    value = int(digits)
    if not _INT_RANGE[0] <= value <= _INT_RANGE[1]:
        raise FrameError(FrameReason.MALFORMED, f"integer {value} beyond 64 bits")
    return value
