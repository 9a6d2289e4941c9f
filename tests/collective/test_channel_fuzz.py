"""Mutated frames through the whole receive path of a PeerChannel.

The wire fuzz tests stop at the payload decoder; this one goes through
`PeerChannel.recv`: sender and job checks, de-duplication, reassembly, the stash,
decoding with the caller's limits, and `accept`.

Every mutant must be refused and the good payload sent after it must arrive
intact, with a job key or without one: a compact frame's tag (an HMAC with a key,
a sha256 digest without) covers its header as well as its body, so a damaged
header cannot take the good frame's place. (The version-1 envelope's sha256
covered the body alone; without a key such mutants could win and time the wait out.)
"""

from __future__ import annotations

import random

import pytest
import torch

from fedring.collective import CollectiveTimeout, PeerChannel
from fedring.compression import GroupTopK, PayloadLimits
from fedring.transport import Deadline, InprocTransport
from fedring.wire import FrameLimits, encode_compact
from fedring.wire.arrays import pack_arrays
from fedring.wire.chunks import split_payload
from fedring.wire.frame import Frame

LIMITS = FrameLimits(max_frame_bytes=8192)  # the payload takes several parts
NUMEL = 100_000  # about 19 KB of payload: five parts


def _good_frames(key: bytes | None) -> tuple[list[bytes], torch.Tensor]:
    x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(1))
    payload = GroupTopK(64, 4, "int8").compress(x)
    meta, arrays = payload.to_wire()
    spec, body = pack_arrays(arrays)
    meta["arrays"] = spec
    template = Frame(kind="chunk", job="j", src="s", dst="r", seq=0, step=3, phase="rs", meta=meta)
    frames = [encode_compact(f, key) for f in split_payload(template, body, 0, LIMITS)]
    return frames, payload.decompress()


def _mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    choice = rng.randrange(4)
    if choice == 0:
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    elif choice == 1:
        b[rng.randrange(len(b))] = rng.randrange(256)
    elif choice == 2:
        del b[rng.randrange(len(b)) :]
    else:
        i = rng.randrange(len(b))
        b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
    return bytes(b)


@pytest.mark.slow
@pytest.mark.parametrize("key", [b"job-key", None], ids=["with-key", "no-key"])
def test_mutants_never_escape_the_channel(key: bytes | None) -> None:
    good, expected = _good_frames(key)
    assert len(good) > 1
    rng = random.Random(20261121)
    outcomes = {"payload": 0, "timeout": 0}
    refused = 0
    for _ in range(2000):
        hub = InprocTransport()
        sender = hub.connect("s")
        receiver = PeerChannel(hub.connect("r"), "j", key=key, limits=LIMITS)
        sender.send("r", _mutate(rng, rng.choice(good)), Deadline.after(1))
        for frame in good:
            sender.send("r", frame, Deadline.after(1))
        try:
            got = receiver.recv(
                "s", round=0, step=3, phase="rs", deadline=Deadline.after(0.2),
                limits=PayloadLimits(max_numel=NUMEL),
            )  # fmt: skip
        except CollectiveTimeout:
            outcomes["timeout"] += 1
            continue
        outcomes["payload"] += 1
        refused += sum(v for k, v in receiver.counters.snapshot().items() if k.startswith("frame_"))
        assert torch.equal(got.decompress(), expected)
    assert outcomes == {"payload": 2000, "timeout": 0}
    assert refused >= 1900  # a few mutants (e.g. a cut after the last byte) are harmless
