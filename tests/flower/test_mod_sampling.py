"""`make_group_topk_mod(sit_out=...)`: what a node back from rounds it sat out does with
its error-feedback residual (keep, reset, decay:G) or with its k (catch-up, pace).

The mod is called directly with fabricated train Messages and one node's Context, as
Flower's ClientApp would call it; the "app" moves the model by a fixed step per round.
Every expectation is recomputed here with `ErrorFeedback` and `GroupTopK` themselves,
so the tests check the policy, not a recording of its output. Milliseconds, no engine.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp.typing import Mod

from fedring.compression.error_feedback import ErrorFeedback
from fedring.compression.group_topk import GroupTopK
from fedring.flower import carrier
from fedring.flower.mod import RECORD, SIT_OUT, STAMP, SitOut, make_group_topk_mod

SHAPE = (64, 32)
NUMEL = 64 * 32
TOPK = GroupTopK.from_density(0.01, 256, "fp16")  # the mod's defaults: k = 3 of 256


def step(rnd: int) -> np.ndarray:
    """What the app adds to the model in round `rnd` (the same for every policy)."""
    return np.random.default_rng(rnd).standard_normal(SHAPE).astype(np.float32)


def global_model(rnd: int) -> np.ndarray:
    return np.zeros(SHAPE, np.float32)  # so that the delta is the step, bit for bit


def train_message(rnd: int | None) -> Message:
    config = ConfigRecord({} if rnd is None else {"server-round": rnd})
    content = RecordDict({
        "arrays": ArrayRecord({"w": Array(global_model(rnd or 0))}),
        "config": config,
        STAMP: ConfigRecord({"key": "arrays"}),
    })  # fmt: skip
    msg = Message(content, dst_node_id=1, message_type="train")
    msg.metadata.__dict__["_message_id"] = f"m{rnd}"
    return msg


def app(msg: Message, context: Context) -> Message:
    rnd = int(msg.content.config_records["config"].get("server-round", 0))  # type: ignore[arg-type]
    w = msg.content.array_records["arrays"]["w"].numpy()
    return Message(RecordDict({"arrays": ArrayRecord({"w": Array(w + step(rnd))})}), reply_to=msg)


def node() -> Context:
    return Context(7, 1, {"partition-id": 0, "num-partitions": 1}, RecordDict(), {})


def train(mod: Mod, context: Context, rnd: int | None) -> torch.Tensor:
    """One train round on `context`; returns the delta the reply carried."""
    reply = mod(train_message(rnd), context, app)
    assert not reply.has_error()
    frames = reply.content.config_records[RECORD]["frames"]
    sent = carrier.unpack(frames, src="node", dst="server", round=rnd or 0, phase="delta",  # type: ignore[arg-type]
                          numel=NUMEL)  # fmt: skip
    return sent.decompress()


def residual(context: Context) -> torch.Tensor:
    return torch.from_numpy(context.state.array_records["fedring.mod.residual"]["r"].numpy())


def expected(rounds: list[int], adjust: dict[int, float], k: dict[int, int] | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Error feedback by hand: the residual is multiplied by adjust[r] before round r;
    returns (the last delta sent, the residual left)."""
    ef = ErrorFeedback(NUMEL)
    sent = torch.zeros(NUMEL)
    for r in rounds:
        ef.residual.mul_(adjust.get(r, 1.0))
        payload = TOPK.compress(ef.compensate(torch.from_numpy(step(r)).reshape(-1)),
                                k=(k or {}).get(r, TOPK.k))  # fmt: skip
        ef.update(payload)
        sent = payload.decompress()
    return sent, ef.residual


POLICIES = ["keep", "reset", "decay:0.5", "catch-up", "catch-up:2", "pace", "pace:5"]


@pytest.mark.parametrize("policy", POLICIES)
def test_at_full_participation_every_policy_keeps_the_residual(policy: str) -> None:
    mod, context = make_group_topk_mod(sit_out=policy), node()
    for r in (1, 2, 3, 4):
        sent = train(mod, context, r)
    want_sent, want_residual = expected([1, 2, 3, 4], {})
    torch.testing.assert_close(sent, want_sent)
    torch.testing.assert_close(residual(context), want_residual, rtol=0, atol=0)
    assert residual(context).abs().sum() > 0  # there was something to keep
    assert dict(context.state.config_records["fedring.mod.round"]) == {"round": 4, "trained": 4}


@pytest.mark.parametrize(
    ("policy", "factor"), [("keep", 1.0), ("reset", 0.0), ("decay:0.5", 0.25), ("decay:0.9", 0.81)]
)
def test_after_missed_rounds_the_residual_is_kept_reset_or_decayed(
    policy: str, factor: float
) -> None:
    mod, context = make_group_topk_mod(sit_out=policy), node()
    train(mod, context, 1)
    train(mod, context, 2)
    sent = train(mod, context, 5)  # rounds 3 and 4 sat out: missed = 2
    want_sent, want_residual = expected([1, 2, 5], {5: factor})
    torch.testing.assert_close(sent, want_sent)
    torch.testing.assert_close(residual(context), want_residual)
    if policy == "reset":  # as if the node had never trained
        fresh = node()
        torch.testing.assert_close(sent, train(mod, fresh, 5))
        torch.testing.assert_close(residual(context), residual(fresh))


@pytest.mark.parametrize(
    ("policy", "rounds", "times"),
    [
        ("catch-up", [1, 2, 5], [1, 1, 3]),  # rounds 3 and 4 missed: k x (1 + 2)
        ("catch-up", [1, 2, 3], [1, 1, 1]),  # none missed: as keep
        ("catch-up", [2, 3], [2, 1]),  # first trained in round 2: round 1 counts
        ("catch-up", [1, 9], [1, 3]),  # 7 missed, capped at 3 k (the default cap)
        ("catch-up:2", [1, 5], [1, 2]),  # 3 missed, capped at 2 k
        ("pace", [1, 2, 3, 4], [1, 1, 1, 1]),  # a round a training: as keep
        ("pace", [2, 4, 6], [2, 2, 2]),  # two rounds a training
        ("pace", [4, 5, 6], [3, 2.5, 2]),  # 4/1 capped at 3, 5/2, 6/3: the mean so far
        ("pace:5", [4, 5], [4, 2.5]),
        ("keep", [3, 8], [1, 1]),
        ("decay:0.5", [3, 8], [1, 1]),
    ],
)
def test_catch_up_and_pace_send_k_times_the_rounds_per_training_up_to_a_cap(
    policy: str, rounds: list[int], times: list[float]
) -> None:
    def per_group(sent: torch.Tensor) -> int:
        return int((sent != 0).sum()) // (NUMEL // 256)

    mod, context = make_group_topk_mod(sit_out=policy), node()
    ks = [int(TOPK.k * t) for t in times]
    for r, want_k in zip(rounds, ks, strict=True):
        sent = train(mod, context, r)
        assert per_group(sent) == want_k, r
    adjust = {r: 0.5 ** (r - rounds[0] - 1) for r in rounds[1:]} if policy == "decay:0.5" else {}
    want_sent, want_residual = expected(rounds, adjust, dict(zip(rounds, ks, strict=True)))
    torch.testing.assert_close(sent, want_sent)
    torch.testing.assert_close(residual(context), want_residual)


def test_without_a_server_round_nothing_counts_as_missed() -> None:
    """A round the node cannot tell (no "server-round" in the message) is never
    taken for rounds missed: the residual is kept, whatever the policy."""
    for rounds in ([None, 5], [3, None, 9]):
        mod, context = make_group_topk_mod(sit_out="reset"), node()
        for r in rounds:
            sent = train(mod, context, r)
        want_sent, want_residual = expected([r or 0 for r in rounds], {})
        torch.testing.assert_close(sent, want_sent)
        torch.testing.assert_close(residual(context), want_residual)


def test_the_policy_is_parsed_and_a_bad_one_refused_at_build_time() -> None:
    assert SitOut.parse("keep") == SitOut("keep")
    assert SitOut.parse("decay:0.7") == SitOut("decay", 0.7)
    assert SitOut.parse("catch-up") == SitOut("catch-up", 3.0)
    assert SitOut.parse("catch-up:4") == SitOut("catch-up", 4.0)
    assert SitOut.parse("pace") == SitOut("pace", 3.0)
    assert SitOut.parse("pace:1.5") == SitOut("pace", 1.5)
    SitOut.parse(SIT_OUT)  # the default parses
    for bad in ("", "drop", "decay", "decay:1.5", "decay:x", "reset:1", "catch-up:0.5", "pace:"):
        with pytest.raises(ValueError, match="sit_out"):
            make_group_topk_mod(sit_out=bad)
