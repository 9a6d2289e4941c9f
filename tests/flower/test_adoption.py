"""How a Flower app written from Flower's docs meets `group_topk_mod` + `CompressedUplinks`.

Issue 17, items 12-15: another ArrayRecord key, a legacy NumPyClient message,
Flower's DP wrapper on either side, replies in another key order or with an extra
array, the mod without the wrapper, and the wrapper standing in for its strategy.
A tiny numpy "model" and a ClientApp that moves it by a fixed step per node keep
every run in-process and deterministic (milliseconds a round).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import (
    DifferentialPrivacyServerSideFixedClipping,
    FedAvg,
    FedAvgM,
    Strategy,
)

from fedring.flower.metering import MeteredGrid
from fedring.flower.mod import (
    RECORD,
    CompressedUplinks,
    UplinkMismatch,
    as_sent,
    group_topk_mod,
)
from tests.flower.inproc_grid import InProcessGrid

NODES = 2
Reply = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]  # trained arrays -> sent


def initial() -> ArrayRecord:
    return ArrayRecord({
        "w": Array(np.zeros((64, 32), np.float32)),
        "b": Array(np.zeros(32, np.float32)),
        "steps": Array(np.array(0, np.int64)),
    })  # fmt: skip


def client(key: str = "arrays", shape_reply: Reply = lambda a: a) -> ClientApp:
    """Each node adds its own fixed step to the floats and 1 to the counter."""
    app = ClientApp(mods=[group_topk_mod])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        assert set(msg.content) == {key, "config"}  # the app sees plain Flower content
        pid = int(context.node_config["partition-id"])
        got = {k: a.numpy() for k, a in msg.content.array_records[key].items()}
        step = np.random.default_rng(pid).standard_normal
        trained = {
            k: v + 1 if v.dtype.kind == "i" else v + step(v.shape).astype(v.dtype)
            for k, v in got.items()
        }
        content = RecordDict({
            key: ArrayRecord({k: Array(np.asarray(v)) for k, v in shape_reply(trained).items()}),
            "metrics": MetricRecord({"num-examples": 10}),
        })  # fmt: skip
        return Message(content, reply_to=msg)

    return app


def fedavg(**kwargs: object) -> FedAvg:
    return FedAvg(fraction_evaluate=0.0, min_available_nodes=NODES, **kwargs)  # type: ignore[arg-type]


def run(strategy: Strategy, app: ClientApp, rounds: int = 2) -> tuple[ArrayRecord, MeteredGrid]:
    grid = MeteredGrid(InProcessGrid(app, NODES))
    result = strategy.start(grid=grid, initial_arrays=initial(), num_rounds=rounds)
    return result.arrays, grid


DENSE_UP = (64 * 32 + 32) * 4  # bytes of one dense float reply


def assert_compressed_and_learned(arrays: ArrayRecord, grid: MeteredGrid, rounds: int = 2) -> None:
    assert list(arrays) == ["w", "b", "steps"]
    assert arrays["steps"].dtype == "int64" and int(arrays["steps"].numpy()) == rounds
    assert np.abs(arrays["w"].numpy()).sum() > 0  # the floats moved
    # density auto in a 2-round run: 37% of 2,080 floats, plus ~1.3 KB of records a reply
    assert grid.totals()["uplink_bytes_per_client"] < DENSE_UP * rounds / 1.8


# --- 12: the inner strategy's key, legacy messages ----------------------------------


def test_another_arrayrecord_key_is_adopted_from_the_inner_strategy() -> None:
    arrays, grid = run(CompressedUplinks(fedavg(arrayrecord_key="weights")), client("weights"))
    assert_compressed_and_learned(arrays, grid)


def test_a_legacy_numpyclient_message_goes_dense_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = ClientApp(mods=[group_topk_mod])

    @app.train()
    def fit(msg: Message, context: Context) -> Message:  # what a NumPyClient's fit replies
        content = RecordDict({
            "fitres.parameters": msg.content.array_records["fitins.parameters"],
            "fitres.num_examples": MetricRecord({"num_examples": 10}),
        })  # fmt: skip
        return Message(content, reply_to=msg)

    msg = Message(
        RecordDict({"fitins.parameters": initial(), "fitins.config": ConfigRecord()}),
        dst_node_id=1, message_type="train",
    )  # fmt: skip
    msg.metadata.__dict__["_message_id"] = "m1"
    with caplog.at_level(logging.WARNING, logger="flwr"):
        reply = app(msg, Context(7, 1, {}, RecordDict(), {}))
    assert list(reply.content.array_records["fitres.parameters"]) == ["w", "b", "steps"]
    assert RECORD not in reply.content
    assert "fedring" in caplog.text and "CompressedUplinks" in caplog.text


def test_a_legacy_strategy_is_refused_by_the_wrapper() -> None:
    from flwr.server.strategy import FedAvg as LegacyFedAvg

    with pytest.raises(TypeError, match=r"CompressedUplinks.*flwr.serverapp.strategy"):
        CompressedUplinks(LegacyFedAvg())  # type: ignore[arg-type]


# --- 13: Flower's DP wrapper ----------------------------------------------------------


def dp(inner: Strategy) -> DifferentialPrivacyServerSideFixedClipping:
    return DifferentialPrivacyServerSideFixedClipping(inner, 0.0, 100.0, NODES)


def test_dp_inside_the_wrapper_runs_compressed() -> None:
    arrays, grid = run(CompressedUplinks(dp(fedavg())), client())
    assert_compressed_and_learned(arrays, grid)


def test_the_wrapper_inside_dp_is_refused_with_the_order_to_use() -> None:
    with pytest.raises(TypeError, match=r"fedring.*outermost.*CompressedUplinks\(Differential"):
        run(dp(CompressedUplinks(fedavg())), client())


# --- 14: replies that do not match, the mod without the wrapper ---------------------


def test_a_reply_in_another_key_order_gives_the_same_model() -> None:
    reordered = client(shape_reply=lambda a: dict(reversed(list(a.items()))))
    want, _ = run(CompressedUplinks(fedavg()), client())
    got, grid = run(CompressedUplinks(fedavg()), reordered)
    assert_compressed_and_learned(got, grid)
    for k in want:
        np.testing.assert_array_equal(got[k].numpy(), want[k].numpy())


def test_the_global_model_keeps_the_order_it_was_sent_in() -> None:
    """FedAvg keeps its first reply's order; a plain node replying in another order
    must not reorder the global model, or the next round's residuals would shift."""
    sent = initial()
    averaged = ArrayRecord({k: sent[k] for k in reversed(list(sent))})
    assert list(as_sent(averaged, sent)) == ["w", "b", "steps"]


def test_a_reply_with_an_extra_array_fails_the_run_naming_the_fix() -> None:
    extra = client(shape_reply=lambda a: {**a, "bonus": np.ones(3, np.float32)})
    with pytest.raises(UplinkMismatch, match=r"fedring.*extra \['bonus'\].*CompressedUplinks"):
        run(CompressedUplinks(fedavg()), extra)


def test_the_mod_without_the_wrapper_sends_dense_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="flwr"):
        arrays, grid = run(fedavg(), client())
    assert list(arrays) == ["w", "b", "steps"]  # never an empty global model
    assert np.abs(arrays["w"].numpy()).sum() > 0
    assert grid.totals()["uplink_bytes_per_client"] > DENSE_UP * 2  # dense, as it said
    assert "fedring" in caplog.text and "CompressedUplinks(" in caplog.text


# --- 15: the wrapper stands in for its strategy ---------------------------------------


def test_the_wrapper_is_its_strategy() -> None:
    inner = FedAvgM(fraction_train=0.5, server_momentum=0.7)
    wrapped = CompressedUplinks(inner)
    assert isinstance(wrapped, FedAvgM) and isinstance(wrapped, FedAvg)
    assert wrapped.fraction_train == 0.5 and wrapped.server_momentum == 0.7
    wrapped.fraction_train = 0.25  # one state: a change through either name is seen by both
    assert inner.fraction_train == 0.25
    arrays, grid = run(CompressedUplinks(FedAvgM(min_available_nodes=NODES, fraction_evaluate=0.0)),
                       client())  # fmt: skip
    assert_compressed_and_learned(arrays, grid)


def test_wrapping_twice_is_refused() -> None:
    with pytest.raises(TypeError, match="already"):
        CompressedUplinks(CompressedUplinks(fedavg()))
