"""Bounded JSON documents: size and depth are checked before `json.loads` runs, and
every way a document can be bad is a `FrameError`, never another exception."""

from __future__ import annotations

import contextlib
import json
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedring.wire.errors import FrameError, FrameReason
from fedring.wire.jsondoc import MAX_DOC_DEPTH, nesting_depth, parse_document


def _reason(data: bytes, **limits: int) -> FrameReason:
    with pytest.raises(FrameError) as caught:
        parse_document(data, **limits)
    return caught.value.reason


def test_a_document_within_the_bounds_is_its_object() -> None:
    doc = {"a": [1, 2.5, {"b": "c]]]["}], "s": 'q"\\[', "n": None, "t": True}
    assert parse_document(json.dumps(doc).encode()) == doc
    assert parse_document(memoryview(b'{"x": 1}')) == {"x": 1}


@pytest.mark.parametrize("depth", [1000, 5000, 100_000])
def test_deep_nesting_is_refused_before_parsing(depth: int) -> None:
    for data in (b"[" * depth + b"]" * depth, b"[" * depth, b'{"a":' * depth, b"{" * depth):
        assert _reason(data) is FrameReason.TOO_DEEP


def test_depth_is_counted_outside_strings_only() -> None:
    inside = json.dumps({"s": "[" * 5000 + '\\"{' * 100}).encode()
    assert nesting_depth(inside) == 1 and parse_document(inside)["s"].startswith("[[")
    # an escaped quote does not end the string; an escaped backslash before one does
    assert nesting_depth(b'{"a": "\\"[[["}') == 1
    assert nesting_depth(b'{"a": "\\\\", "b": [[[]]]}') == 4
    assert nesting_depth(b"") == 0 and nesting_depth(b"]]]") == 0


def test_the_depth_limit_is_exact() -> None:
    at = b"[" * (MAX_DOC_DEPTH - 1) + b"{}" + b"]" * (MAX_DOC_DEPTH - 1)
    assert parse_document(b'{"a":' + at + b"}", max_depth=MAX_DOC_DEPTH + 1) == {
        "a": json.loads(at)
    }
    assert _reason(b'{"a":' + at + b"}") is FrameReason.TOO_DEEP


def test_a_document_with_fewer_brackets_than_the_limit_is_not_scanned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its depth is at most its opening brackets: a round's row, one object, skips the
    scan; one bracket more than the limit is scanned, and nested that deep, refused."""
    from fedring.wire import jsondoc

    scans: list[bytes] = []
    monkeypatch.setattr(jsondoc, "nesting_depth", lambda d: scans.append(d) or nesting_depth(d))
    at = b"[" * (MAX_DOC_DEPTH - 1) + b"]" * (MAX_DOC_DEPTH - 1)
    assert parse_document(b'{"a":' + at + b"}")["a"] == json.loads(at)  # MAX_DOC_DEPTH deep
    assert parse_document(b'{"round": 3, "loss": 0.5, "s": "[[{{"}')["round"] == 3
    assert scans == []
    assert _reason(b'{"a":[' + at + b"]}") is FrameReason.TOO_DEEP and len(scans) == 1


def test_size_is_checked_first() -> None:
    big = b'{"a": "' + b"x" * 2000 + b'"}'
    assert _reason(big, max_bytes=1024) is FrameReason.OVERSIZE
    assert parse_document(big, max_bytes=4096)["a"] == "x" * 2000


@pytest.mark.parametrize(
    "data",
    [b"", b"   ", b"[1, 2]", b'"text"', b"3", b"null", b"{", b"{'a': 1}", b'{"a": 1} x',
     b'{"a": NaN', b"\xff\xfe{}", b'{"a": "\xc3"}', b"\xef\xbb\xbf{}", b'{"a": 1,}'],
)  # fmt: skip
def test_anything_but_one_json_object_is_malformed(data: bytes) -> None:
    assert _reason(data) is FrameReason.MALFORMED


def test_integers_beyond_64_bits_are_refused() -> None:
    """``float()`` of such an int raises OverflowError wherever a figure is read."""
    assert _reason(b'{"step_s": ' + b"9" * 400 + b"}") is FrameReason.MALFORMED
    assert _reason(b'{"step_s": ' + b"9" * 5000 + b"}") is FrameReason.MALFORMED
    assert parse_document(b'{"n": -9223372036854775808, "m": 18446744073709551615}')["n"] < 0


def test_a_hostile_megabyte_is_scanned_quickly() -> None:
    """The scan is linear: quotes and backslashes cannot make it quadratic."""
    for data in (b'"\\' * 500_000, b'{"a":"' + b'\\"' * 500_000, b"[]" * 500_000, b'"' * 10**6):
        start = time.perf_counter()
        with pytest.raises(FrameError):
            parse_document(data, max_bytes=2**21)
        assert time.perf_counter() - start < 0.5


@given(st.binary(max_size=4096))
def test_any_bytes_are_an_object_or_a_frame_error(data: bytes) -> None:
    with contextlib.suppress(FrameError):
        assert isinstance(parse_document(data), dict)


@given(st.recursive(st.none() | st.integers() | st.text(max_size=8),
                    lambda kids: st.lists(kids, max_size=3)
                    | st.dictionaries(st.text(max_size=4), kids, max_size=3),
                    max_leaves=30))  # fmt: skip
def test_the_scan_agrees_with_the_nesting_of_any_document(value: object) -> None:
    def depth(v: object) -> int:
        if isinstance(v, list):
            return 1 + max(map(depth, v), default=0)
        if isinstance(v, dict):
            return 1 + max(map(depth, v.values()), default=0)
        return 0

    assert nesting_depth(json.dumps({"v": value}).encode()) == 1 + depth(value)
    assert nesting_depth(json.dumps({"v": value}, ensure_ascii=False).encode()) == 1 + depth(value)
