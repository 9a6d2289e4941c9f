"""The live views of a job (progress line, metrics, dashboard) against real runs: a real
Mosquitto, agent daemons and a coordinator as processes (the MQTT tests' helpers)."""

from tests.mqtt.conftest import MISSING, broker, fleet  # noqa: F401 - fixtures, reused

__all__ = ["MISSING"]
