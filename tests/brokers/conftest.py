"""The brokers fedring is run on besides a plain Mosquitto, started by PID on loopback.

``mosquitto``: the reference (tests/mqtt's broker). ``aedes``: a second implementation,
MQTT 3.1.1 only (npm; `fedring.transport.aedes`). ``aws``: a Mosquitto with AWS IoT
Core's limits (`AWS_IOT_CORE`: 128 KiB packets, QoS 0/1); its agents connect with
``?protocol=auto`` and learn the cap from the MQTT 5 CONNACK, its coordinator with
MQTT 3.1.1 and ``?max_message=128k``, so both ways of knowing the cap are exercised.

A broker that cannot be started here is skipped with the reason (CI installs both).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from fedring.transport.aedes import Aedes, AedesMissing
from fedring.transport.mosquitto import AWS_IOT_CORE, Mosquitto, MosquittoMissing

BROKERS = ("mosquitto", "aedes", "aws")


@dataclass(frozen=True)
class Broker:
    """A running broker: the URL its agents use, and the one its coordinator uses."""

    name: str
    agents_url: str
    coordinator_url: str
    server: Mosquitto | Aedes


def start_broker(name: str, workdir: Path) -> Mosquitto | Aedes:
    """Start broker `name` in `workdir`; skip the test (with the reason) if it cannot be."""
    try:
        if name == "aedes":
            return Aedes(workdir=workdir).start()
        limits = AWS_IOT_CORE if name == "aws" else None
        return Mosquitto(workdir=workdir, limits=limits).start()
    except (AedesMissing, MosquittoMissing) as exc:
        pytest.skip(f"broker {name} is not installed here: {exc}")


def urls(name: str, url: str) -> tuple[str, str]:
    if name == "aws":
        return f"{url}?protocol=auto", f"{url}?max_message=128k"
    return url, url


@pytest.fixture(scope="module", params=BROKERS)
def broker(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[Broker]:  # fmt: skip
    name = request.param
    server = start_broker(name, tmp_path_factory.mktemp(name))
    try:
        yield Broker(name, *urls(name, server.url), server)
    finally:
        server.stop()
