"""ClientApp: plain Flower, except two of the four lines of the adoption: the import of
`group_topk_mod` and the line marked `fedring`."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedring.flower.mod import group_topk_mod
from flower_app import task

app = ClientApp(mods=[group_topk_mod])  # fedring: compressed uplinks (plain: ClientApp())


@app.train()
def train(msg: Message, context: Context) -> Message:
    torch.set_num_threads(1)
    net = task.model()
    net.load_state_dict(msg.content.array_records["arrays"].to_torch_state_dict())
    pid, n = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    steps = int(context.run_config.get("local-steps", 12))
    lr = float(context.run_config.get("lr", 0.05))
    server_round = int(msg.content.config_records["config"]["server-round"])  # type: ignore[arg-type]
    loss = task.train(net, pid, n, steps, lr, server_round)
    metrics = MetricRecord({"train_loss": loss, "num-examples": len(task.partition(pid, n)[1])})
    content = RecordDict({"arrays": ArrayRecord(net.state_dict()), "metrics": metrics})
    return Message(content, reply_to=msg)
