"""The pipeline grid's frames through a real Mosquitto: every worker on its own MQTT
link ends with the same parameters, bit for bit, as the in-process grid on the same job."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from fedring.engine.reducer import ReducerSettings
from fedring.engine.sampler import ShardSampler
from fedring.pipeline.grid import GridWorker, PipelineSettings, ShardBatches, build_grid, run_steps
from fedring.training.models import params_sha256
from fedring.transport.base import Endpoint
from fedring.transport.inproc import InprocTransport
from fedring.transport.mosquitto import Mosquitto
from fedring.transport.mqtt import BrokerConfig, MqttLink
from tests.pipeline.test_equivalence import model_of, plan_for

GEN = torch.Generator().manual_seed(7)
X, Y = torch.randn(96, 6, generator=GEN), torch.randint(0, 3, (96,), generator=GEN)
STEPS = 6


def grid(starts: list[int], replicas: int, connect: Callable[[str], Endpoint] | None,
         hub: InprocTransport | None, job: str) -> list[list[GridWorker]]:  # fmt: skip
    model = model_of(7, 3)
    return build_grid(
        list(model), plan_for(model, starts, 3, "1f1b"), replicas, PipelineSettings(3, "1f1b"),
        loss_fn=F.cross_entropy,
        make_optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
        reducer_settings=ReducerSettings(density=0.1, group_size=16, density_warmup=2),
        data=lambda d: ShardBatches(X[d::replicas], Y[d::replicas],
                                    ShardSampler(len(X) // replicas, batch_size=12, seed=0,
                                                 rank=d)),
        hub=hub, connect=connect, job=job,
    )  # fmt: skip


def hashes(g: list[list[GridWorker]]) -> list[str]:
    return [params_sha256(w.stage.module) for row in g for w in row]


@pytest.mark.parametrize(("starts", "replicas"), [([0, 2, 5], 1), ([0, 3], 2)],
                         ids=["S3", "S2xD2"])  # fmt: skip
def test_grid_over_mosquitto_ends_bit_for_bit_as_in_process(
    broker: Mosquitto, starts: list[int], replicas: int
) -> None:
    torch.set_num_threads(1)
    hub = InprocTransport(cooperative=True)
    local = grid(starts, replicas, None, hub, "pp")
    run_steps(local, start=0, steps=STEPS, lr_at=lambda s: 0.05, hub=hub)

    job = f"pp-s{len(starts)}-d{replicas}"
    links: list[MqttLink] = []

    def connect(name: str) -> Endpoint:
        link = MqttLink(BrokerConfig.parse(broker.url), name, job=job).connect()
        links.append(link)
        return link.endpoint(job)

    try:
        remote = grid(starts, replicas, connect, None, job)
        run_steps(remote, start=0, steps=STEPS, lr_at=lambda s: 0.05)
        sent = [w.stage.channel.endpoint.stats.bytes_sent for row in remote for w in row]
    finally:
        for link in links:
            link.close()
    assert all(sent), sent  # every worker's frames went through the broker
    assert hashes(remote) == hashes(local)
    fresh = grid(starts, replicas, None, InprocTransport(), "pp")  # the test can fail
    assert hashes(fresh) != hashes(local)
