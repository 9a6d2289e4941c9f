"""Compressed uplinks under Flower's own client sampling: the mod's sit-out policies
against plain Flower FedAvg, measured in one run.

`examples/flower_app` on the simulation engine (digits, MLP, 17,226 parameters, iid
shards, H = 12 momentum-SGD steps of 32 samples, lr 0.05), `--clients` nodes of
which FedAvg samples `--per-round` (``fraction_train``) each round with Flower's own
`random.sample`, seeded, the nodes listed in partition order (`flower_app.metered`):
every run of a seed trains the same partitions in the same rounds (checked). Rows:

- plain Flower FedAvg, dense fp32 both ways;
- the same app with its four fedring lines (`group_topk_mod` + `CompressedUplinks`,
  group-top-k 1% fp16 + error feedback), once per `sit_out` policy of
  `make_group_topk_mod`. A node back after m rounds sat out: ``keep`` its residual,
  ``reset`` it, ``decay:G`` it (x G**m); ``catch-up[:C]`` sends k x (1 + m) entries a
  group, ``pace[:C]`` k x (rounds per training so far), both at most C x k (C = 3).
  ``POLICY@D`` runs the policy at density D instead of 1%;
- references at full participation (every node every round, so no round is ever
  missed and every policy is `keep`): plain FedAvg and the mod (`--no-full` skips).

Accuracy is on the held-out digits (360 samples: one sample is 0.28 pp): after the
last round (``acc``), after a quarter of the rounds (``acc@R``), and the steadier mean
over the last 10 rounds (``last10``); ``vs FedAvg`` is taken seed by seed against
plain FedAvg, then averaged. Uplink bytes are what Flower moves per client over the
run, counted on the deflated message objects (`fedring.flower.metering`); ``x fewer``
is FedAvg's uplink bytes per reply divided by the run's (the same as per client
where both sampled the same nodes). Wall seconds: the ServerApp's, per run.

    python bench/flower_sampling.py [--clients 50] [--per-round 10 | --fraction 0.2]
        [--rounds 40] [--seeds 1] [--policies keep,reset,...] [--no-full] [--json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from fedring.flower.mod import SIT_OUT, SitOut
from fedring.flower.simulation import simulate_apps

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "flower_app"
POLICIES = ("keep", "reset", "decay:0.5", "decay:0.8", "catch-up", "pace", "pace:4", "keep@0.035")
PLAIN = "plain Flower FedAvg (dense)"
LAST = 10  # rounds averaged for the steadier accuracy


def example(variant: str, clients: int, fraction: float, rounds: int, seed: int, out: Path,
            policy: str | None = None) -> dict[str, Any]:  # fmt: skip
    env = {"PYTHONPATH": str(EXAMPLE), "FEDRING_FLOWER_ROUNDS": str(rounds),
           "FEDRING_FLOWER_CLIENTS": str(clients), "FEDRING_FLOWER_SEED": str(seed),
           "FEDRING_FLOWER_FRACTION": repr(fraction)}  # fmt: skip
    if policy is not None:
        sit_out, _, density = policy.partition("@")
        env["FEDRING_FLOWER_SIT_OUT"] = sit_out
        if density:
            env["FEDRING_FLOWER_DENSITY"] = density
    return simulate_apps(f"flower_app.metered:{variant}_server",
                         f"flower_app.metered:{variant}_client", clients, out,
                         timeout_s=1200, env=env)  # fmt: skip


def accuracy(r: dict[str, Any]) -> tuple[float, float]:
    """(accuracy after round rounds/4, mean accuracy over the last LAST rounds)."""
    acc = {int(k): v for k, v in r["accuracy"].items()}
    last = [acc[k] for k in sorted(acc)[-LAST:]]
    return acc[max(1, r["rounds"] // 4)], sum(last) / len(last)


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def row(runs: list[dict[str, Any]], bases: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over the seeds; accuracy differences are taken seed by seed."""
    early, last = zip(*(accuracy(r) for r in runs), strict=True)
    base_last = [accuracy(b)[1] for b in bases]
    per_reply = mean([r["uplink_bytes_total"] / r["replies_received"] for r in runs])
    base_per_reply = mean([b["uplink_bytes_total"] / b["replies_received"] for b in bases])
    final_pp = [
        100 * (r["final_accuracy"] - b["final_accuracy"]) for r, b in zip(runs, bases, strict=True)
    ]
    last_pp = [100 * (x - b) for x, b in zip(last, base_last, strict=True)]
    return {
        "final_accuracy": mean([r["final_accuracy"] for r in runs]),
        "accuracy_vs_fedavg_pp": mean(final_pp),
        "early_accuracy": mean(list(early)),
        "last10_accuracy": mean(list(last)),
        "last10_vs_fedavg_pp": mean(last_pp),
        "per_seed": {"final_vs_fedavg_pp": final_pp, "last10_vs_fedavg_pp": last_pp},
        "rounds": runs[0]["rounds"],
        "fraction_train": runs[0]["fraction_train"],
        "uplink_bytes_per_client": mean([r["uplink_bytes_per_client"] for r in runs]),
        "uplink_bytes_per_reply": per_reply,
        "uplink_ratio_vs_fedavg": base_per_reply / per_reply,
        "wall_seconds": mean([r["wall_seconds"] for r in runs]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=50)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--per-round", type=int, default=10, help="clients sampled a round")
    group.add_argument("--fraction", type=float, help="FedAvg's fraction_train instead")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--seeds", type=int, default=1, help="sampling seeds 0..N-1, averaged")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="sit_out policies, comma-separated; POLICY@DENSITY for another "
                             "density")  # fmt: skip
    parser.add_argument("--no-full", action="store_true", help="skip the full-participation rows")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    fraction = args.fraction if args.fraction is not None else args.per_round / args.clients
    policies = [p for p in args.policies.split(",") if p]
    for p in policies:
        SitOut.parse(p.partition("@")[0])  # a typo fails here, not after the first runs
    n, rounds = args.clients, args.rounds
    runs: dict[str, list[dict[str, Any]]] = {
        name: [] for name in [PLAIN] + [f"mod, {p}" for p in policies]
    }
    full: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="fedring-bench-") as tmp:
        t = Path(tmp)
        for seed in range(args.seeds):
            runs[PLAIN].append(example("plain", n, fraction, rounds, seed, t / f"plain{seed}"))
            for p in policies:
                runs[f"mod, {p}"].append(
                    example("compressed", n, fraction, rounds, seed, t / f"{p}{seed}", p)
                )
        if not args.no_full and fraction < 1.0:  # every node every round: no seed to vary
            full["plain FedAvg (dense)"] = [example("plain", n, 1.0, rounds, 0, t / "fp")]
            full["mod (every policy: none missed)"] = [
                example("compressed", n, 1.0, rounds, 0, t / "fc")
            ]
    for name, rs in runs.items():  # the claim the table rests on: the same clients each round
        for seed, (r, b) in enumerate(zip(rs, runs[PLAIN], strict=True)):
            if r["trained"] != b["trained"]:
                raise SystemExit(f"{name}, seed {seed}: other clients than plain FedAvg trained")
    full_base = next(iter(full.values()), [])
    result: dict[str, Any] = {
        "clients": n, "fraction_train": fraction, "per_round": len(runs[PLAIN][0]["trained"][0]),
        "rounds": rounds, "seeds": args.seeds, "default_sit_out": SIT_OUT,
        "runs": {name: row(rs, runs[PLAIN]) for name, rs in runs.items()},
        "full_participation": {name: row(rs, full_base) for name, rs in full.items()},
    }  # fmt: skip
    if args.json:
        print(json.dumps(result, sort_keys=True))
        return
    print(f"digits, MLP, {n} clients, {result['per_round']} sampled a round (FedAvg fraction_train "
          f"{fraction:g}, seeded), {rounds} rounds, Flower simulation engine, mean of "
          f"{args.seeds} sampling seed(s); mod = group-top-k 1% fp16 + error feedback, "
          "sit_out policy[@density]")  # fmt: skip
    cols = ("acc", "vs FedAvg", f"acc@{max(1, rounds // 4)}", f"last{LAST}", "vs FedAvg",
            "uplink B/client", "x fewer", "wall s")  # fmt: skip
    widths = (7, 10, 7, 7, 10, 15, 8, 7)
    print(f"{'':30} " + " ".join(f"{c:>{w}}" for c, w in zip(cols, widths, strict=True)))
    full_title = "full participation (all clients every round), vs FedAvg there:"
    for title, rows in (("", result["runs"]), (full_title, result["full_participation"])):
        if title and rows:
            print(title)
        for name, x in rows.items():
            print(f"{name:30} {x['final_accuracy']:7.4f} {x['accuracy_vs_fedavg_pp']:+8.2f}pp "
                  f"{x['early_accuracy']:7.4f} "
                  f"{x['last10_accuracy']:7.4f} {x['last10_vs_fedavg_pp']:+8.2f}pp "
                  f"{x['uplink_bytes_per_client']:15,.0f} {x['uplink_ratio_vs_fedavg']:7.1f}x "
                  f"{x['wall_seconds']:7.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
