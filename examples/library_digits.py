"""The default digits job written with fedring's public API only, as a user would.

`fedring simulate` (defaults), the MQTT daemons with `fedring coordinator run
examples/digits.toml`, and this script train the same model: four agents, the
default MLP on scikit-learn's digits, group-top-k 1% with error feedback, plain
SGD at 0.1 scaled linearly x4 with a 50-step warm-up, stop at 95% test accuracy.
They print the same sha256 of the final parameters (tests/engine/test_library.py
and tests/mqtt/test_job.py check it).

    python examples/library_digits.py [--rounds 600] [--target 0.95]
"""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor

import torch

import fedring
from fedring.training.models import params_sha256

AGENTS, BATCH, LR, SEED = 4, 32, 0.1, 0


def train_agent(group: fedring.Group, plan: fedring.Plan, rank: int, rounds: int,
                target: float) -> torch.nn.Module:  # fmt: skip
    task = plan.task  # its shard verified, the plan's initial parameters hash-checked:
    model, x, y = fedring.prepare(
        task, plan.dataset, plan.manifest, plan.shards[rank], rank, seed=SEED,
        model_sha256=plan.model_sha256, initial=plan.initial,
    )  # fmt: skip
    inner = torch.optim.SGD(model.parameters(), lr=LR)  # plain EF-SGD: no momentum
    settings = fedring.ReducerSettings(density="auto", rounds=rounds)  # as `fedring simulate`
    reducer = fedring.Reducer(group.collective, sum(p.numel() for p in model.parameters()),
                              settings)  # fmt: skip
    opt = fedring.DistributedOptimizer(inner, reducer, model=model, weight=plan.weights[rank])
    scaling = fedring.LinearScaling(inner, world=AGENTS, batch_size=BATCH, warmup_steps=50)
    sampler = fedring.ShardSampler(len(x), batch_size=BATCH, seed=SEED, rank=rank)
    try:
        for step in range(rounds):
            scaling.apply(step)
            idx = torch.tensor(sampler.next_batch())
            model.train()
            opt.zero_grad()
            task.loss(model(x[idx]), y[idx]).backward()
            opt.step()  # the group agrees on the compressed gradient, SGD steps
            if (step + 1) % 10 == 0 and task.evaluate(model, plan.dataset)[1] >= target:
                break  # every agent holds the same parameters: all stop at the same step
    except BaseException:
        group.channel.endpoint.close()  # neighbours fail fast instead of waiting out a deadline
        raise
    finally:
        opt.close()
    return model


def main(rounds: int = 600, target: float = 0.95) -> dict[str, object]:
    torch.set_num_threads(1)  # four agent threads
    plan = fedring.plan(fedring.ClassificationTask("digits", "mlp"), agents=AGENTS, seed=SEED)
    groups = fedring.local_group(AGENTS)
    with ThreadPoolExecutor(AGENTS) as pool:
        futures = [pool.submit(train_agent, groups[r], plan, r, rounds, target)
                   for r in range(AGENTS)]  # fmt: skip
        models = [f.result() for f in futures]
    accuracy = plan.task.evaluate(models[0], plan.dataset)[1]
    return {"accuracy": accuracy, "hashes": sorted({params_sha256(m) for m in models})}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=600)
    parser.add_argument("--target", type=float, default=0.95)
    args = parser.parse_args()
    out = main(args.rounds, args.target)
    print(f"accuracy {out['accuracy']:.4f}; model sha256 {', '.join(out['hashes'])}")
