"""The byte goals of the benchmarks, which are deterministic (timings are not tested)."""

from __future__ import annotations

from fedring.bench import compress, ring
from fedring.compression import GroupTopK


def test_wire_bytes_are_at_least_100x_below_dense_at_density_1pct_fp16() -> None:
    r = compress.run(numel=1_000_000, density=0.01, repeats=1)
    assert r["compression_ratio"] >= 100, r["compression_ratio"]
    assert r["bytes_compressed"] > r["bytes_payload"]  # headers are counted, not left out


def test_bounded_ring_sends_at_least_100x_fewer_bytes_than_dense_at_8_agents() -> None:
    row = ring.run_one(8, 1_000_000, GroupTopK.from_density(0.01, 256, "fp16"), seed=0)
    assert row["bounded"]["ratio_vs_dense"] >= 100, row["bounded"]
    assert row["bounded"]["max_abs_err"] < 1e-4  # result + kept == sum of inputs
    assert row["exact"]["max_abs_err"] < 1e-4
    assert row["dense"]["max_abs_err"] < 1e-4


def test_accuracy_compare_sets_every_run_beside_the_first() -> None:
    from fedring.bench.accuracy import compare

    base = {"agents": 2, "rounds": 5, "eval_every": 5}
    runs = {"dense": {"compression": "none"}, "topk": {}}
    table = compare(base, runs, seeds=[0, 1])
    assert table["dense"]["pp_vs_dense"] == 0 and table["dense"]["bytes_ratio_vs_dense"] == 1
    assert table["topk"]["bytes_ratio_vs_dense"] > 3  # 1% of 17 K values against fp32
    t = table["topk"]
    assert t["accuracy_min"] <= t["accuracy_mean"] <= t["accuracy_max"]
