"""An asynchronous centre's patch replies (`engine.async_reply`, `compression.model_patch`):
exact, smaller than dense, dense where no base is known, refused when they do not
make the centre's model, and the same training as dense replies, bit for bit."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from torch import nn

from fedring.collective.channel import PeerChannel
from fedring.collective.payloads import decode_payload, encode_payload
from fedring.compression.group_topk import GroupTopK
from fedring.compression.model_patch import ModelPatch
from fedring.compression.payload import PayloadLimits
from fedring.compression.quantize import DenseChunk, DenseCodec
from fedring.engine.async_reply import AsyncBase, AsyncReplies
from fedring.engine.centre import (
    STAR,
    AsyncSettings,
    AsyncState,
    Centre,
    run_async_member,
    serve_async,
)
from fedring.engine.group import LOCAL_KEY
from fedring.engine.local import LocalWork
from fedring.engine.sampler import ShardSampler
from fedring.training.models import flat_sha256
from fedring.transport.base import Deadline
from fedring.transport.inproc import InprocTransport
from fedring.wire.errors import FrameError, FrameReason
from fedring.wire.patch import apply_patch, encode_patch

D = 70_000  # above 65,536: the i4 form is reachable


def _moved(model: torch.Tensor, at: torch.Tensor, seed: int) -> torch.Tensor:
    new = model.clone()
    new[at] += torch.randn(at.numel(), generator=torch.Generator().manual_seed(seed))
    return new


def _wire(p: ModelPatch) -> ModelPatch:
    meta, body = encode_payload(p)
    got = decode_payload(meta, bytearray(body), PayloadLimits(max_numel=p.numel))
    assert isinstance(got, ModelPatch)
    return got


@pytest.mark.parametrize(("changed", "form"), [(7_000, "g1"), (40, "i4")])
def test_a_patch_makes_the_centres_model_bit_for_bit_and_is_smaller(
    changed: int, form: str
) -> None:
    v0 = torch.randn(D, generator=torch.Generator().manual_seed(0))
    v0[:5] = -0.0  # a -0.0 travels as itself: the base stays the centre's bits
    replies = AsyncReplies(v0, version=0)
    base = AsyncBase()
    first = replies.reply("a", v0, 0)
    assert isinstance(first, DenseChunk)  # no base known yet
    taken = base.take(first)
    assert taken is not None and flat_sha256(taken) == flat_sha256(torch.zeros(D) + v0)
    model, at = v0, torch.randperm(D, generator=torch.Generator().manual_seed(1))[:changed]
    for v, part in enumerate(at.chunk(3), start=1):  # three versions since the member's base
        new = _moved(model, part, v)
        replies.applied(model, new, v)
        model = new
    patch = _wire(replies.reply("a", model, 3))  # as the member decodes it
    assert isinstance(patch, ModelPatch) and patch.index == form
    assert (patch.base, patch.version, patch.sha256) == (0, 3, flat_sha256(model))
    assert patch.positions.numel() == changed
    assert patch.wire_nbytes < DenseCodec("fp32").compress(model).wire_nbytes / 2
    trained = base.take(patch)
    # what the dense reply of the same model trains on (its -0.0 read +0.0), bit for bit
    dense = DenseCodec("fp32").compress(model).decompress()
    assert trained is not None and flat_sha256(trained) == flat_sha256(dense)
    assert base.model is not None and flat_sha256(base.model) == flat_sha256(model)
    # the same entries and values as the checkpoint stream's patch of the same change
    doc, blob = encode_patch(v0.numpy(), model.numpy(), lo=0)
    target = v0.numpy().copy()
    apply_patch(target, doc, blob)
    assert doc["index"] == form and np.array_equal(target.view(np.uint32),
                                                   model.numpy().view(np.uint32))  # fmt: skip


def test_dense_where_the_base_is_unknown_too_old_or_most_entries_moved() -> None:
    v0 = torch.zeros(D)
    replies = AsyncReplies(v0, version=5)
    replies.reply("a", v0, 5)
    v6 = _moved(v0, torch.arange(D), 6)  # a dense update: every entry moved
    replies.applied(v0, v6, 6)
    assert isinstance(replies.reply("a", v6, 6), DenseChunk)
    assert isinstance(replies.reply("b", v6, 6), DenseChunk)  # never sent anything
    replies.holds["c"] = 4  # older than the centre's log (an earlier epoch's model)
    assert isinstance(replies.reply("c", v6, 6), DenseChunk)
    v7 = _moved(v6, torch.arange(10), 7)
    replies.applied(v6, v7, 7)
    assert isinstance(replies.reply("a", v7, 7), ModelPatch)
    assert isinstance(replies.reply("a", v7, 7, dense=True), DenseChunk)  # asked again
    assert replies.counters.get("async_reply_patch") == 1
    assert replies.counters.get("async_reply_dense") == 5


def test_a_member_refuses_a_patch_that_does_not_make_the_centres_model() -> None:
    v0 = torch.randn(D, generator=torch.Generator().manual_seed(0))
    replies = AsyncReplies(v0, version=0)
    v1 = _moved(v0, torch.arange(100), 1)
    replies.applied(v0, v1, 1)
    replies.holds["a"] = 0
    patch = replies.reply("a", v1, 1)
    assert isinstance(patch, ModelPatch)
    assert AsyncBase().take(patch) is None  # no base
    stale = AsyncBase()
    stale.take(DenseCodec("fp32").compress(_moved(v0, torch.tensor([D - 1]), 9)))
    assert stale.take(patch) is None  # another base: the hash disagrees
    assert stale.counters.get("async_patch_refused") == 1 and stale.model is None
    small = AsyncBase()
    small.take(DenseCodec("fp32").compress(torch.zeros(10)))
    assert small.take(patch) is None  # another size


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("sha256", "xyz", FrameReason.SHAPE_MISMATCH),
        ("index", "dense", FrameReason.BAD_DTYPE),
        ("base", 99, FrameReason.SHAPE_MISMATCH),  # after the version it makes
        ("n", 10**9, FrameReason.SHAPE_MISMATCH),
        ("counts", 1, FrameReason.SHAPE_MISMATCH),  # counts that do not sum to n
        ("where", 0, FrameReason.INDEX_OUT_OF_RANGE),  # positions not increasing
        ("last", 0, FrameReason.INDEX_OUT_OF_RANGE),  # a position past the model
        ("val", float("nan"), FrameReason.NON_FINITE),
    ],
)
def test_a_malformed_patch_from_the_network_is_refused_naming_the_field(
    field: str, value: object, reason: FrameReason
) -> None:
    numel = 1000  # the g1 form: 4 groups, entries 3 and 700 moved
    patch = ModelPatch.build(numel, base=1, version=2, sha256="a" * 64, index="g1",
                             counts=np.array([1, 0, 1, 0], dtype=np.uint8),
                             where=np.array([3, 700 - 512], dtype=np.uint8),
                             values=torch.tensor([1.0, 2.0]))  # fmt: skip
    meta, body = encode_payload(patch)
    arrays = bytearray(body)
    if field in meta:
        meta[field] = value
    elif field == "counts":  # body: counts [0:4], where [4:6], padding, values [8:16]
        arrays[0] = 2
    elif field == "where":  # both in group 0, at the same place
        arrays[0:4] = bytes([2, 0, 0, 0])
        arrays[4:6] = bytes([3, 3])
    elif field == "last":  # group 3's places 232 and 233: entries 1000 and 1001
        arrays[0:4] = bytes([0, 0, 0, 2])
        arrays[4:6] = bytes([232, 233])
    else:
        arrays[-4:] = np.float32(value).tobytes()
    with pytest.raises(FrameError) as got:
        decode_payload(meta, arrays, PayloadLimits(max_numel=numel))
    assert got.value.reason == reason and (field in str(got.value) or field in
                                          ("counts", "where", "last", "val"))  # fmt: skip


def _work(seed: int) -> LocalWork:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(256, 64, generator=g), torch.randint(0, 10, (256,), generator=g)
    return LocalWork(model, x, y, nn.functional.cross_entropy,
                     ShardSampler(256, batch_size=32, seed=seed),
                     torch.optim.SGD(model.parameters(), lr=0.1))  # fmt: skip


def _job(patches: bool) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """One member for 30 versions (so the order of arrivals is fixed): the centre's
    final model, the member's, the centre's bytes sent and the patches it sent."""
    hub = InprocTransport()
    centre = PeerChannel(hub.connect(STAR), "job", key=LOCAL_KEY)
    member = PeerChannel(hub.connect("a"), "job", key=LOCAL_KEY)
    work = _work(0)
    state = AsyncState(work.params.clone())
    settings = AsyncSettings(rounds=30, timeout_s=20, patch_replies=patches)
    thread = threading.Thread(target=serve_async, args=(centre, ("a",), state, settings))
    thread.start()
    topk = GroupTopK.from_density(0.01, 256, "fp16")
    cycles = run_async_member(work, Centre(member), topk.compress, steps=2, lr=0.1, timeout_s=20)
    thread.join(20)
    assert cycles == 30 and not thread.is_alive()
    return (state.model, work.params, centre.endpoint.stats.bytes_sent,
            centre.counters.get("async_reply_patch"))  # fmt: skip


def test_patch_replies_train_exactly_as_dense_replies_for_fewer_bytes() -> None:
    dense_model, dense_member, dense_bytes, none = _job(patches=False)
    model, member, sent, patches = _job(patches=True)
    assert none == 0 and patches == 28  # all but the first reply and the last (whole)
    assert flat_sha256(model) == flat_sha256(dense_model)
    assert flat_sha256(member) == flat_sha256(dense_member) == flat_sha256(model)
    assert sent < dense_bytes / 5, (sent, dense_bytes)


def test_the_centre_answers_again_with_the_whole_model() -> None:
    hub = InprocTransport()
    centre = PeerChannel(hub.connect(STAR), "job", key=LOCAL_KEY)
    a = PeerChannel(hub.connect("a"), "job", key=LOCAL_KEY)
    state = AsyncState(torch.zeros(D))
    thread = threading.Thread(target=serve_async, args=(
        centre, ("a",), state, AsyncSettings(rounds=3, timeout_s=10)))  # fmt: skip
    thread.start()
    delta = torch.zeros(D)
    delta[:50] = 1.0

    def cycle(rnd: int, phase: str = "up") -> tuple[str, object]:
        deadline = Deadline.after(10)
        sent = DenseCodec("fp32").compress(delta) if phase == "up" else (
            DenseChunk(D, 0, torch.empty(0)))  # fmt: skip
        a.send(STAR, sent, round=rnd, step=0, phase=phase, deadline=deadline)
        (_s, _r, _t, got), reply = a.recv_any((STAR,), phases=("down", "end"), deadline=deadline)
        return got, reply

    assert isinstance(cycle(0)[1], DenseChunk)  # first: whole
    assert isinstance(cycle(1)[1], ModelPatch)
    phase, again = cycle(1, "again")  # applies nothing, sends the model whole
    assert phase == "down" and isinstance(again, DenseChunk) and state.version == 2
    assert torch.equal(again.decompress()[:50], torch.full((50,), 2.0))
    phase, last = cycle(2)
    thread.join(10)
    assert phase == "end" and isinstance(last, DenseChunk) and state.version == 3
    assert centre.counters.get("async_reply_dense") == 3


def test_an_update_of_the_wrong_size_loses_its_member_not_the_centre() -> None:
    """A signed member sending 10 entries for a model of D: counted, that member is taken
    for lost, and the centre goes on serving the others to the last version."""
    hub = InprocTransport()
    centre = PeerChannel(hub.connect(STAR), "job", key=LOCAL_KEY)
    a = PeerChannel(hub.connect("a"), "job", key=LOCAL_KEY)
    b = PeerChannel(hub.connect("b"), "job", key=LOCAL_KEY)
    state = AsyncState(torch.zeros(D))
    thread = threading.Thread(target=serve_async, args=(
        centre, ("a", "b"), state, AsyncSettings(rounds=2, timeout_s=10)))  # fmt: skip
    thread.start()
    deadline = Deadline.after(10)
    a.send(STAR, DenseCodec("fp32").compress(torch.ones(10)), round=0, step=0, phase="up",
           deadline=deadline)  # fmt: skip
    phases = []
    for rnd in range(2):
        b.send(STAR, DenseCodec("fp32").compress(torch.ones(D)), round=rnd, step=0,
               phase="up", deadline=deadline)  # fmt: skip
        (_s, _r, _t, phase), _reply = b.recv_any((STAR,), phases=("down", "end"),
                                                 deadline=deadline)  # fmt: skip
        phases.append(phase)
    thread.join(10)
    assert not thread.is_alive() and phases == ["down", "end"] and state.version == 2
    assert state.lost == ["a"] and centre.counters.get("async_wrong_size") == 1
    assert torch.equal(state.model, torch.full((D,), 2.0))
