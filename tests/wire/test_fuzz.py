"""Seeded fuzzing of the whole receive path: only `FrameError` may come out.

Two phases, both seeded with `random.Random`:

- bytes: a dozen valid encoded frames (signed and unsigned; group-top-k payloads
  with fp16, int8 and fp32 values, a dense chunk, group-sparse and int8 payloads,
  single parts of a multi-part split) are mutated as bytes: bit flips, byte
  substitutions, truncations, insertions, duplicated slices, splices of two frames
  and changes to msgpack type bytes. Almost all must be refused.
- payload: meta and body of valid payloads are mutated *before* encoding, and the
  result is framed, signed and split like a real sender would, as from a peer that
  holds the key but sends nonsense. These pass every envelope check and exercise
  `Reassembler`, `decode_payload` and `decompress`.

Every mutant goes through what `PeerChannel` does with a delivery:

    decode_frame -> Reassembler.add -> decode_payload -> payload.decompress()

Anything raised other than `FrameError` is collected with the mutant's hex and
reported together at the end.
"""

from __future__ import annotations

import copy
import random
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import msgpack
import pytest
import torch

from fedring.collective.payloads import decode_payload, encode_payload
from fedring.compression import (
    DenseChunk,
    GroupSparse,
    GroupTopK,
    Int8Quantizer,
    PayloadLimits,
    SignBits,
    SignQuantizer,
)
from fedring.compression.payload import Payload
from fedring.wire.chunks import Reassembler, split_payload
from fedring.wire.errors import FrameError, FrameReason
from fedring.wire.frame import Frame, FrameLimits, decode_frame, encode_frame

SEED = 20240611
MUTANTS_PER_BASE = 3000  # byte phase: 12 bases
PAYLOAD_MUTANTS_PER_BASE = 1000  # payload phase: 11 payloads
KEY = b"fuzz-key"
PAYLOAD_LIMITS = PayloadLimits(max_numel=1 << 20)
SMALL = FrameLimits(max_frame_bytes=8192)  # max_body_bytes 4096: forces multi-part
DEFAULT = FrameLimits()


Signature = tuple[str, str, str, str]


# --------------------------------------------------------------------------- payloads


def _x(numel: int, seed: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def make_payloads() -> dict[str, Payload]:
    sparse_x = torch.where(_x(600, 5) > 1.0, _x(600, 6), torch.zeros(600))
    return {
        "topk-fp16": GroupTopK(group_size=100, k=5, value_dtype="fp16").compress(_x(1000, 1)),
        "topk-int8": GroupTopK(group_size=256, k=4, value_dtype="int8").compress(_x(1500, 2)),
        "topk-u2": GroupTopK(group_size=1000, k=3, value_dtype="fp32").compress(_x(2500, 3)),
        "topk-bf16": GroupTopK(group_size=64, k=2, value_dtype="bf16").compress(
            _x(700, 9), groups=(2, 9)
        ),
        "dense-fp16": DenseChunk(numel=400, start=64, values=_x(96, 4).to(torch.float16)),
        "dense-i2": DenseChunk(numel=50, start=10, values=torch.arange(-8, 8, dtype=torch.int16)),
        "group-sparse": GroupSparse.from_dense(sparse_x, 64, (0, 10)),
        "int8-dense": Int8Quantizer(group_size=32).compress(_x(200, 7)),
        "sign-scaled": SignQuantizer(group_size=16).compress(_x(100, 10)),
        "sign-3state": SignBits.from_signs(torch.tensor([1, 0, -1] * 11, dtype=torch.int8), 40, 5),
        "topk-big": GroupTopK(group_size=256, k=16, value_dtype="fp32").compress(_x(40_000, 8)),
    }


def frames_for(
    meta: dict[str, Any], body: bytes, limits: FrameLimits, seq: int, phase: str = "reduce"
) -> list[Frame]:
    template = Frame(
        kind="chunk",
        job="job-7",
        src="a3",
        dst="a4",
        seq=0,
        round=2,
        step=1,
        phase=phase,
        meta=meta,
    )
    return split_payload(template, body, seq, limits)


# --------------------------------------------------------------------------- receive


def receive(frames: Sequence[bytes | Frame], key: bytes | None, limits: FrameLimits) -> str:
    """Feed frames (encoded, or already decoded siblings) through the receive path.

    Returns "payload", "pending" or "reject:<reason>"; any other exception escapes.
    """
    try:
        reasm = Reassembler(limits)
        done = None
        for item in frames:
            frame = decode_frame(item, key, limits) if isinstance(item, bytes) else item
            done = reasm.add(frame)
        if done is None:
            return "pending"
        head, body = done
        payload = decode_payload(head.meta, body, PAYLOAD_LIMITS)
        out = payload.decompress()
        assert out.dtype == torch.float32 and out.numel() == payload.numel
    except FrameError as exc:
        assert isinstance(exc.reason, FrameReason)
        return f"reject:{exc.reason.value}"
    return "payload"


# --------------------------------------------------------------------------- byte bases


@dataclass
class Base:
    name: str
    data: bytes  # the encoded frame to mutate
    key: bytes | None
    limits: FrameLimits
    siblings: list[Frame] = field(default_factory=list)  # the other parts, fed first

    def receive(self, data: bytes) -> str:
        return receive([*self.siblings, data], self.key, self.limits)


def _single(name: str, payload: Payload, key: bytes | None, seq: int) -> Base:
    (frame,) = frames_for(*encode_payload(payload), DEFAULT, seq)
    return Base(name, encode_frame(frame, key), key, DEFAULT)


def _split(name: str, payload: Payload, key: bytes | None, which: int) -> Base:
    frames = frames_for(*encode_payload(payload), SMALL, 100, phase="gather")
    assert len(frames) >= 3, len(frames)
    which %= len(frames)
    siblings = [f for i, f in enumerate(frames) if i != which]
    return Base(name, encode_frame(frames[which], key), key, SMALL, siblings)


def make_bases() -> list[Base]:
    p = make_payloads()
    bases = [
        _single("topk-fp16-key", p["topk-fp16"], KEY, 1),
        _single("topk-fp16-nokey", p["topk-fp16"], None, 2),
        _single("topk-int8-key", p["topk-int8"], KEY, 3),
        _single("topk-int8-nokey", p["topk-int8"], None, 4),
        _single("topk-u2-nokey", p["topk-u2"], None, 5),
        _single("dense-key", p["dense-fp16"], KEY, 6),
        _single("dense-nokey", p["dense-fp16"], None, 7),
        _single("group-sparse-nokey", p["group-sparse"], None, 8),
        _single("int8-dense-key", p["int8-dense"], KEY, 9),
        _split("split-first-key", p["topk-big"], KEY, 0),
        _split("split-last-nokey", p["topk-big"], None, -1),
        _split("split-middle-nokey", p["topk-big"], None, 1),
    ]
    for base in bases:  # every base is accepted untouched
        assert base.receive(base.data) == "payload", base.name
    return bases


# --------------------------------------------------------------------------- byte mutators


def type_offsets(data: bytes) -> list[int]:
    """Offsets of every msgpack type byte in a valid encoding (headers of all values)."""
    offsets: list[int] = []
    # float32/64, uint8..64, int8..64: fixed-width payloads after the type byte
    fixed = dict(zip(range(0xCA, 0xD4), (4, 8, 1, 2, 4, 8, 1, 2, 4, 8), strict=True))
    sized = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4}

    def walk(pos: int) -> int:
        offsets.append(pos)
        b = data[pos]
        pos += 1
        if b <= 0x7F or b >= 0xE0 or b in (0xC0, 0xC2, 0xC3):
            return pos
        if 0x80 <= b <= 0x8F:
            return walk_items(pos, 2 * (b & 0x0F))
        if 0x90 <= b <= 0x9F:
            return walk_items(pos, b & 0x0F)
        if 0xA0 <= b <= 0xBF:
            return pos + (b & 0x1F)
        if b in fixed:
            return pos + fixed[b]
        if b in sized:
            w = sized[b]
            return pos + w + int.from_bytes(data[pos : pos + w], "big")
        if b in (0xDC, 0xDD, 0xDE, 0xDF):
            w = 2 if b in (0xDC, 0xDE) else 4
            n = int.from_bytes(data[pos : pos + w], "big")
            return walk_items(pos + w, n * (2 if b >= 0xDE else 1))
        raise AssertionError(f"unexpected type byte {b:#x} at {pos - 1}")  # no ext in bases

    def walk_items(pos: int, n: int) -> int:
        for _ in range(n):
            pos = walk(pos)
        return pos

    assert walk(0) == len(data)
    return offsets


_TYPE_BYTES = bytes.fromhex(
    "00017f80818f90919fa0a1bfc0c1c2c3c4c5c6c7c8c9cacbcccdcecfd0d3d4d5d8d9dadbdcdddedfe0ff"
)
_INTERESTING = bytes([0x00, 0x01, 0x7F, 0x80, 0xFF]) + _TYPE_BYTES


@dataclass
class Ctx:
    type_offsets: list[int]
    others: list[bytes]


Mutator = Callable[[random.Random, bytes, Ctx], bytes]


def flip_bits(rng: random.Random, data: bytes, ctx: Ctx) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.choice((1, 1, 1, 2, 3, 8))):
        buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
    return bytes(buf)


def substitute(rng: random.Random, data: bytes, ctx: Ctx) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.choice((1, 1, 2, 4))):
        pos = rng.randrange(len(buf))
        buf[pos] = rng.choice(_INTERESTING) if rng.random() < 0.5 else rng.randrange(256)
    return bytes(buf)


def truncate(rng: random.Random, data: bytes, ctx: Ctx) -> bytes:
    if rng.random() < 0.3:
        return data[rng.randrange(len(data)) :]  # drop a prefix
    return data[: rng.randrange(len(data))]


def insert(rng: random.Random, data: bytes, ctx: Ctx) -> bytes:
    pos = rng.randrange(len(data) + 1)
    blob = bytes(rng.randrange(256) for _ in range(rng.choice((1, 1, 2, 4, 16))))
    return data[:pos] + blob + data[pos:]


def duplicate_slice(rng: random.Random, data: bytes, ctx: Ctx) -> bytes:
    a = rng.randrange(len(data))
    b = min(len(data), a + rng.randint(1, 64))
    pos = rng.randrange(len(data) + 1)
    return data[:pos] + data[a:b] + data[pos:]


def splice(rng: random.Random, data: bytes, ctx: Ctx) -> bytes:
    other = rng.choice(ctx.others)
    if rng.random() < 0.2:
        return data + other  # two whole frames back to back
    return data[: rng.randrange(len(data) + 1)] + other[rng.randrange(len(other) + 1) :]


def mutate_type_byte(rng: random.Random, data: bytes, ctx: Ctx) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.choice((1, 1, 2))):
        pos = rng.choice(ctx.type_offsets)
        old = buf[pos]
        roll = rng.random()
        if 0xA0 <= old <= 0xAF and roll < 0.3:
            # a short str retyped as an array (or map) of as many items: ASCII bytes
            # are positive fixints, so the frame stays well-formed around it
            n = old & 0x0F
            buf[pos] = 0x90 | n if n % 2 or rng.random() < 0.5 else 0x80 | n // 2
        elif roll < 0.4:
            buf[pos] = rng.choice(_TYPE_BYTES)
        elif roll < 0.8:
            buf[pos] = (old + rng.choice((-2, -1, 1, 2))) % 256  # neighbouring type or length
        else:
            buf[pos] = rng.randrange(256)
    return bytes(buf)


MUTATORS: dict[str, Mutator] = {
    "flip_bits": flip_bits,
    "substitute": substitute,
    "truncate": truncate,
    "insert": insert,
    "duplicate_slice": duplicate_slice,
    "splice": splice,
    "type_byte": mutate_type_byte,
}
_BODY_MUTATORS = ("flip_bits", "substitute", "truncate", "insert", "duplicate_slice")


# --------------------------------------------------------------------------- meta mutators

_ODD_INTS = [0, 1, -1, 2, 3, 7, 8, 255, 256, 257, 65535, 65536, 65537, 2**31]
_ODD_BIG = [1 << 20, (1 << 20) + 1, 2**63 - 1, -(2**63)]
_ODD_SCALARS = [1.5, float("nan"), float("inf"), None, True, False, "", "x", b"\x00", b"u1"]
_ODD_DTYPES = ["u1", "u2", "i1", "i2", "i4", "f2", "f4", "bf16", "f8", "c8"]
_ODD_CONTAINERS: list[Any] = [[], [0], [0, 0], [1, 0], [0, 1, 2], {}, {"u1": 1}]
_ODD: list[Any] = [*_ODD_INTS, *_ODD_BIG, *_ODD_SCALARS, *_ODD_DTYPES, *_ODD_CONTAINERS]
_CODECS = ["dense", "int8", "sign", "group-topk", "group-sparse"]


def _containers(node: Any, out: list[Any]) -> list[Any]:
    if isinstance(node, (dict, list)):
        out.append(node)
        for child in node.values() if isinstance(node, dict) else node:
            _containers(child, out)
    return out


def mutate_meta(rng: random.Random, meta: dict[str, Any]) -> dict[str, Any]:
    meta = copy.deepcopy(meta)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        node = rng.choice(_containers(meta, []))
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        roll = rng.random()
        if not keys or roll < 0.08:  # add an entry
            value = copy.deepcopy(rng.choice(_ODD))
            if isinstance(node, dict):
                node[rng.choice(["extra", "scale", "nz", "val", "k", "range", "groups"])] = value
            else:
                node.insert(rng.randrange(len(node) + 1), value)
            continue
        where = rng.choice(keys)
        old = node[where]
        if roll < 0.16:
            del node[where]
        elif roll < 0.22 and where == "codec":
            node[where] = rng.choice(_CODECS)
        elif roll < 0.6 and type(old) is int:
            node[where] = max(-(2**63), min(2**63 - 1, old + rng.choice((-2, -1, 1, 2, old, -old))))
        else:
            node[where] = copy.deepcopy(rng.choice(_ODD))
    return meta


# --------------------------------------------------------------------------- the runs


@dataclass
class Report:
    total: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    by_mutator: Counter[str] = field(default_factory=Counter)
    crashes: list[tuple[Signature, str, str]] = field(default_factory=list)
    seconds: float = 0.0

    def record(self, mutator: str, run: Callable[[], str], mutant_hex: Callable[[], str]) -> None:
        self.total += 1
        self.by_mutator[mutator] += 1
        try:
            outcome = run()
        except Exception as exc:  # anything but FrameError is a finding
            sig, where = _signature(exc)
            self.crashes.append((sig, mutant_hex(), where))
            outcome = "crash"
        self.outcomes[outcome] += 1

    def rejected(self) -> int:
        return sum(n for o, n in self.outcomes.items() if o.startswith("reject:"))

    def reasons(self) -> set[str]:
        return {o.removeprefix("reject:") for o in self.outcomes if o.startswith("reject:")}

    def summary(self, crashes: list[tuple[Signature, str, str]]) -> str:
        lines = [f"{len(crashes)} of {self.total} mutants raised something other than FrameError:"]
        for sig, n in Counter(sig for sig, _, _ in crashes).most_common():
            _, hexdata, where = next(c for c in crashes if c[0] == sig)
            lines.append(f"  {n} x {sig[0]}: {sig[1]} at {where}\n    mutant: {hexdata}")
        return "\n".join(lines)


def _signature(exc: BaseException) -> tuple[Signature, str]:
    last = traceback.extract_tb(exc.__traceback__)[-1]
    filename = last.filename.replace("\\", "/").rsplit("/", 1)[-1]
    short = str(exc).split(":")[0][:60]
    where = f"{filename}:{last.lineno} in {last.name}"
    return (type(exc).__name__, short, filename, last.name), where


def run_byte_fuzz(seed: int = SEED, per_base: int = MUTANTS_PER_BASE) -> Report:
    rng = random.Random(seed)
    bases = make_bases()
    pool = [b.data for b in bases]
    report = Report()
    names = list(MUTATORS)
    start = time.perf_counter()
    for base in bases:
        ctx = Ctx(type_offsets(base.data), pool)
        for _ in range(per_base):
            name = rng.choice(names)
            mutant = MUTATORS[name](rng, base.data, ctx)
            if mutant == base.data:
                continue
            report.record(name, partial(base.receive, mutant), mutant.hex)
    report.seconds = time.perf_counter() - start
    return report


def _describe(meta: dict[str, Any], body: bytes) -> str:
    return f"meta={meta!r} body={body.hex()}"


def run_payload_fuzz(seed: int = SEED, per_payload: int = PAYLOAD_MUTANTS_PER_BASE) -> Report:
    rng = random.Random(seed + 1)
    report = Report()
    start = time.perf_counter()
    empty = Ctx([], [])
    for i, (name, payload) in enumerate(make_payloads().items()):
        meta, body = encode_payload(payload)
        key = KEY if i % 2 else None
        limits = SMALL if name == "topk-big" else DEFAULT
        for _ in range(per_payload):
            roll = rng.random()
            kind = "meta" if roll < 0.45 else "body" if roll < 0.85 else "both"
            m = mutate_meta(rng, meta) if kind != "body" else meta
            b = body
            if kind != "meta":
                b = MUTATORS[rng.choice(_BODY_MUTATORS)](rng, body, empty)
            if (m, b) == (meta, body):
                continue
            encoded = [encode_frame(f, key) for f in frames_for(m, b, limits, seq=7)]
            report.record(kind, partial(receive, encoded, key, limits), partial(_describe, m, b))
    report.seconds = time.perf_counter() - start
    return report


@pytest.fixture(scope="module")
def byte_report() -> Report:
    return run_byte_fuzz()


@pytest.fixture(scope="module")
def payload_report() -> Report:
    return run_payload_fuzz()


# --------------------------------------------------------------------------- tests


def test_type_offsets_cover_a_frame() -> None:
    meta = {"l": [1, -1, 2.5]}
    frame = Frame(kind="chunk", job="j", src="a", dst="b", seq=300, meta=meta, body=b"\x00" * 300)
    data = encode_frame(frame, KEY)
    offsets = type_offsets(data)
    assert offsets[0] == 0 and data[0] == 0x8C  # 12 fields: sealed, no sha256, no mac
    # the map, 12 keys and values, 2 part items, meta's key and value, 3 list items
    assert len(offsets) == 1 + 2 * 12 + 2 + 2 + 3


def test_mutators_change_and_stay_deterministic() -> None:
    base = make_bases()[0]
    ctx = Ctx(type_offsets(base.data), [base.data[::-1]])
    for name, mutator in MUTATORS.items():
        a = [mutator(random.Random(i), base.data, ctx) for i in range(20)]
        b = [mutator(random.Random(i), base.data, ctx) for i in range(20)]
        assert a == b, name
        assert sum(m != base.data for m in a) >= 18, name


@pytest.mark.slow
def test_byte_fuzz_raises_only_frame_error(byte_report: Report) -> None:
    if byte_report.crashes:
        pytest.fail(byte_report.summary(byte_report.crashes))


@pytest.mark.slow
def test_byte_fuzz_mostly_rejected(byte_report: Report) -> None:
    r = byte_report
    print(f"\nbytes: {r.total} mutants in {r.seconds:.1f} s: {dict(r.outcomes)}")
    assert r.total >= 10_000, r.total
    assert set(r.by_mutator) == set(MUTATORS)
    assert min(r.by_mutator.values()) > 1000, r.by_mutator
    assert r.rejected() / r.total > 0.95, r.outcomes
    # the mutants reach every layer of the envelope: msgpack, shape, fields, integrity
    envelope = (
        "truncated trailing_bytes malformed non_string_keys oversize too_deep unknown_field "
        "bad_kind bad_version bad_sha256 bad_mac bad_part"
    )
    for reason in envelope.split():
        assert reason in r.reasons(), (reason, r.outcomes)


@pytest.mark.slow
def test_payload_fuzz_raises_only_frame_error(payload_report: Report) -> None:
    if payload_report.crashes:
        pytest.fail(payload_report.summary(payload_report.crashes))


@pytest.mark.slow
def test_payload_fuzz_reaches_payload_checks(payload_report: Report) -> None:
    r = payload_report
    print(f"\npayload: {r.total} mutants in {r.seconds:.1f} s: {dict(r.outcomes)}")
    assert r.total >= 5000, r.total
    assert r.outcomes["payload"] > 0  # e.g. flipped value bits still decode
    assert r.rejected() > r.total // 2, r.outcomes
    checks = "unknown_codec bad_dtype shape_mismatch index_out_of_range non_finite oversize"
    for reason in checks.split():
        assert reason in r.reasons(), (reason, r.outcomes)


def test_fuzz_is_deterministic() -> None:
    first, second = (run_byte_fuzz(seed=7, per_base=40) for _ in range(2))
    assert first.outcomes == second.outcomes and first.total == second.total > 400
    first, second = (run_payload_fuzz(seed=7, per_payload=20) for _ in range(2))
    assert first.outcomes == second.outcomes and first.total == second.total > 150


def test_retyped_meta_value_is_refused_not_crashed() -> None:
    # A spot check of the payload path: "numel" turned from an int into nil is a
    # well-formed frame that the payload decoder refuses.
    meta, body = encode_payload(DenseChunk(numel=100, start=0, values=torch.ones(4)))
    frame = Frame(kind="chunk", job="j", src="a", dst="b", seq=0, meta=meta, body=body)
    raw = msgpack.unpackb(encode_frame(frame), raw=False)
    raw["meta"]["numel"] = None
    data = msgpack.packb(raw, use_bin_type=True)
    assert receive([data], None, DEFAULT) == "reject:shape_mismatch"
