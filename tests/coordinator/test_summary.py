"""The job's summary assembled from plain values (`coordinator.summary`): no broker,
no files."""

from __future__ import annotations

from typing import Any

from fedring.coordinator.epoch import Epoch
from fedring.coordinator.membership import Fleet
from fedring.coordinator.summary import Centre, assemble, describe_layout, model_hashes


def _epoch() -> Epoch:
    ep = Epoch(2, ["a0", "a1", "a2"], 10, gone={"a2"})
    ep.done = {
        "a1": {"sha256": "m", "accuracy": 0.5, "threads": 3, "ring_bytes_sent": 100,
               "link_bytes_sent": 150, "checkpoint_bytes_sent": "lots",  # not a number: 0
               "counters": {"x": 1}},
        "a0": {"sha256": "m", "accuracy": 0.9, "test_loss": 0.2, "rounds": 40,
               "ring_bytes_sent": 300, "link_bytes_sent": 450, "checkpoint_bytes_sent": 90},
    }  # fmt: skip
    return ep


def _summary(ep: Epoch, **over: Any) -> dict[str, Any]:
    fleet = Fleet(hellos={"a0": {"machine": "x86_64"}, "a1": {"machine": "aarch64"}})
    args: dict[str, Any] = dict(
        job="digits-1", ep=ep, reformations=2, events=[{"why": "a2 lost"}], fleet=fleet,
        drift={}, wall_s=12.5, checkpoint="out/checkpoint.pt", checkpoint_round=40,
        counters={"agent_lost": 1}, bytes_received=7, bytes_sent=8, centre_rounds=0,
        degraded=0, centre=None, onnx=None, layout="ring of 3", collective=[],
    )  # fmt: skip
    return assemble(**{**args, **over})


def test_the_head_speaks_for_the_job_and_every_member_is_counted() -> None:
    s = _summary(_epoch())
    assert (s["final_accuracy"], s["test_loss"], s["rounds"]) == (0.9, 0.2, 40)
    assert s["model_hashes"] == ["m"] and s["identical_models"]
    assert s["epochs"] == 3 and s["reformations"] == 2 and s["lost"] == ["a2"]
    # every byte a member sent, and what it went to: the ring, the checkpoint, the rest
    assert s["agent_bytes"] == {
        "a1": {"ring": 100, "checkpoint": 0, "control": 50, "link": 150},
        "a0": {"ring": 300, "checkpoint": 90, "control": 60, "link": 450},
    }
    assert s["bytes_sent_per_agent"] == 300.0
    assert s["bytes_sent_per_agent_split"] == {"ring": 200.0, "checkpoint": 45.0, "control": 55.0}
    assert s["machines"] == {"a0": "x86_64", "a1": "aarch64", "a2": ""}
    assert s["agent_threads"] == {"a1": 3, "a0": 0}
    assert "onnx" not in s and "staleness" not in s


def test_a_head_that_did_not_say_bye_leaves_another_member_to_speak() -> None:
    ep = _epoch()
    del ep.done["a0"]
    assert _summary(ep)["final_accuracy"] == 0.5


def test_members_that_disagree_are_not_identical() -> None:
    ep = _epoch()
    ep.done["a1"]["sha256"] = "n"
    assert model_hashes(ep) == ["m", "n"] and not _summary(ep)["identical_models"]


def test_an_asynchronous_job_counts_the_centres_versions() -> None:
    s = _summary(_epoch(), centre=Centre(version=55, staleness={2: 4, 0: 9}), onnx={"ok": True})
    assert s["rounds"] == 55 and s["staleness"] == {"0": 9, "2": 4}
    assert s["onnx"] == {"ok": True}


def test_the_layout_in_words() -> None:
    assert describe_layout(True, "ring", "ring", 4) == "async star"
    assert describe_layout(False, "star", "ring", 4) == "star of 4"
    assert describe_layout(False, "auto", "fanout", 4) == "fanout of 4"
    assert describe_layout(False, "ring", "ring", 4) == "ring of 4"
