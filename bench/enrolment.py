"""Enrolment bytes per agent at 10, 50 and 100 agents: flat in N (issue 15).

Before, each enrolment carried the whole shard table (every shard's size and
sha256): N rows to each of N agents. Now an agent gets its own row (MQTT) or only
the table's sha256 (Flower: a node shards the data itself and checks the hash).

Columns, per agent, from one run:

- ``flower run``: the enrol message (job, hashes, the initial model when sent),
  measured on a real Flower simulation (`fedring flower simulate`, one round):
  the ServerApp's enrolment downlink total / N;
- ``flower msg`` and ``flower, table``: the same message built here, without and
  with the whole table (as it was), counted by `fedring.flower.metering.message_bytes`
  (the count the ServerApp's grid meter uses);
- ``mqtt``: the coordinator's manifest for the agent as encoded in its frames
  (`coordinator.manifest.segment_docs`, `ControlCodec`), and ``mqtt, table`` with the
  whole table in place of the row and every member's name in place of the
  agent's ring contacts (as it was).

    python bench/enrolment.py [--agents 10 50 100] [--init derived|sent] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from flwr.app import ConfigRecord, Message
from flwr.common import MessageType
from flwr.supercore.task_identity import TaskIdentity

from fedring.build import plan
from fedring.config import JobSpec
from fedring.coordinator.checkpoint import Checkpoint
from fedring.coordinator.manifest import segment_docs
from fedring.flower.job import FlowerJob
from fedring.flower.metering import message_bytes
from fedring.flower.server_app import enrol_content
from fedring.flower.simulation import simulate
from fedring.wire.control import ControlCodec


def flower_message(spec: JobSpec, table: bool) -> int:
    p = plan(spec)
    content = enrol_content(spec, p)
    if table:  # what the enrol message carried before: every shard's size and sha256
        m = p.manifest
        content["plan"] = ConfigRecord({
            **dict(content["plan"]), "dataset": m.dataset, "scheme": m.scheme,
            "seed": m.seed, "n_agents": m.n_agents, "sizes": list(m.sizes),
            "digests": list(m.digests),
        })  # fmt: skip
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1  # as a ServerApp's
    msg = Message(content, dst_node_id=1, message_type=f"{MessageType.QUERY}.enrol")
    return message_bytes(msg)


def mqtt_manifest(spec: JobSpec, table: bool) -> int:
    p = plan(spec)
    members = [f"agent-{i:03d}" for i in range(spec.agents)]
    ck = Checkpoint(
        job="digits-0123abcd", key=os.urandom(32), spec=spec.resolved(),
        shards={a: i for i, a in enumerate(members)}, model_sha256=p.model_sha256,
        shard_manifest=p.manifest.to_dict(), epoch=0, round=0, params=None,
    )  # fmt: skip
    agent = members[-1]
    doc = segment_docs(ck, members, 0, 0, 0)[agent]
    if table:  # before: the whole shard table and every member's name
        doc = {**doc, "shards": ck.shard_manifest, "members": members}
        del doc["shard_entry"], doc["peers"]
    codec = ControlCodec("coordinator", ck.key)
    return sum(len(f) for f in codec.encode("manifest", ck.job, agent, doc, sign=False))


def flower_run(spec: JobSpec) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        summary = simulate(FlowerJob(spec), Path(tmp))
    if summary["status"] != "completed":
        raise SystemExit(f"{spec.agents} nodes: the Flower run failed: {summary.get('error')}")
    return summary["enrol_downlink_bytes_total"] / spec.agents


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, nargs="+", default=[10, 50, 100])
    parser.add_argument("--init", choices=("derived", "sent"), default="derived",
                        help="sent adds the initial model (69 KB here) to every enrolment")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    for n in args.agents:
        spec = JobSpec(dataset="digits", agents=n, rounds=1, eval_every=1, init=args.init,
                       topology="star")
        rows.append({
            "agents": n, "flower": flower_run(spec),
            "flower_message": flower_message(spec, table=False),
            "flower_table": flower_message(spec, table=True),
            "mqtt": mqtt_manifest(spec, table=False), "mqtt_table": mqtt_manifest(spec, table=True),
        })  # fmt: skip
    if args.json:
        print(json.dumps(rows))
        return
    print(f"enrolment bytes per agent, digits, init={args.init}")
    print(f"{'agents':>7} {'flower run':>11} {'flower msg':>11} {'flower, table':>14} "
          f"{'mqtt':>8} {'mqtt, table':>12}")  # fmt: skip
    for r in rows:
        print(f"{r['agents']:>7} {r['flower']:>11,.0f} {r['flower_message']:>11,} "
              f"{r['flower_table']:>14,} {r['mqtt']:>8,} {r['mqtt_table']:>12,}")  # fmt: skip
    print("flower run: the ServerApp's enrolment downlink / N in a real simulation (the "
          "node ids\nin its metadata are longer than the message built here, `flower msg`)")

if __name__ == "__main__":
    main()
