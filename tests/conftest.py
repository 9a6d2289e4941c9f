"""Shared test settings: hypothesis without per-example deadlines (threads, 2 cores)."""

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "fedring",
    deadline=None,
    max_examples=60,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("fedring")

# `make test` runs two pytest-xdist workers (`--dist loadgroup`). Suites that start
# many processes or share machine-wide state run in lanes: each lane's tests one
# after another on one worker, so they never contend with themselves (Flower's
# SuperLink/Ray sessions; the lab's namespaces, which its clean-up finds by prefix).
# Everything else (in-process tests) is spread over both workers.
#
# The MQTT suite is two lanes, its files taken alternately by name (`_mqtt_lane`): as
# one lane it ran 1,835 s of a 1,857 s suite (`--durations=0`, the 2-core sandbox,
# 2026-11-27), so one worker ran it all while the other idled at the end. Its two
# halves (1,042 s and 793 s) now run beside each other as the other lanes do.
LANES = {
    "flower": ("tests/flower/", "tests/bench/test_flower_fedavg.py"),
    "mqtt": ("tests/mqtt/",),  # split in two by `_mqtt_lane`
    "monitor": ("tests/monitor/",),  # its own broker and fleet: beside the mqtt lane
    "brokers": ("tests/brokers/",),  # other broker implementations and capped brokers
    "lab": ("tests/lab/", "tests/bench/test_ddp.py", "tests/engine/test_ddp_",
            "tests/bench/test_ddp_hook_cuda.py"),  # gloo worlds, one at a time
}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the marks into the
def pytest_collection_modifyitems(config, items) -> None:  # type: ignore[no-untyped-def]
    # node ids (`...@lab`): registered after this file, it would run first and see none
    mqtt_files = sorted({i.nodeid.split("::")[0] for i in items
                         if i.nodeid.startswith(LANES["mqtt"])})  # fmt: skip
    for item in items:
        path = item.nodeid
        for lane, prefixes in LANES.items():
            if path.startswith(prefixes):
                if lane == "mqtt":
                    lane = _mqtt_lane(path.split("::")[0], mqtt_files)
                item.add_marker(pytest.mark.xdist_group(lane))


def _mqtt_lane(path: str, files: list[str]) -> str:
    """The lane of an MQTT test file: every other file, in name order, is "mqtt-b"."""
    return "mqtt-b" if files.index(path) % 2 else "mqtt"
