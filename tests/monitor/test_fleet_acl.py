"""`fedring fleet` on a broker with users and the example ACL (examples/mosquitto.acl).

The ACL's read-only ``operator`` sees every field; a user the ACL lets read statuses
only is told so (a warning naming the topics), and its live board is not shown lost
for want of beats it may not read. Mosquitto grants such subscriptions and delivers
nothing, so only the absence can tell.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedring.cli import app
from fedring.transport.mosquitto import Mosquitto
from tests.mqtt.conftest import MISSING, Fleet, wait_for

pytestmark = pytest.mark.skipif(bool(MISSING), reason=MISSING or "mosquitto present")

EXAMPLE_ACL = Path(__file__).parents[2] / "examples" / "mosquitto.acl"
PASSWORD = "fleet-test-pw"


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A broker with users a0, operator and nobody; agent a0 running as its own user."""
    work = tmp_path_factory.mktemp("fleet-acl")
    pw = work / "password"
    pw.write_text(PASSWORD + "\n")
    users = dict.fromkeys(("a0", "operator", "nobody"), PASSWORD)
    with Mosquitto(users=users, acl=EXAMPLE_ACL, workdir=work / "broker") as broker:
        fleet = Fleet(broker.url, work / "logs", extra={"a0": [
            "--username", "a0", "--password-file", str(pw), "--keepalive", "2"]})  # fmt: skip
        fleet.start("a0")
        try:
            yield broker.url, pw
        finally:
            assert fleet.stop() == {"a0": 0}


def look(url: str, user: str, pw: Path) -> dict:
    done = CliRunner().invoke(app, ["fleet", "--broker", url, "--json", "--username", user,
                                    "--password-file", str(pw)])  # fmt: skip
    assert done.exit_code == 0, done.output
    return json.loads(done.stdout)


def test_the_operator_sees_every_field_and_a_status_only_user_is_warned(
    secured: tuple[str, Path],
) -> None:
    url, pw = secured
    docs: list[dict] = []

    def described() -> bool:
        docs.append(look(url, "operator", pw))
        rows = docs[-1]["boards"]
        return len(rows) == 1 and rows[0]["fedring"] != "" and rows[0]["rss_bytes"] is not None

    wait_for(described, 60, "a0's hello and beats, read as the operator")
    [board] = docs[-1]["boards"]
    assert board["state"] == "online" and board["why"] == "beating" and board["torch"]
    assert docs[-1]["warnings"] == []

    began = time.monotonic()
    doc = look(url, "nobody", pw)
    [board] = doc["boards"]
    assert board["state"] == "online" and board["why"] == "no beat heard yet"  # not "lost"
    assert board["fedring"] == "" and board["last_beat_s"] is None
    assert time.monotonic() - began < 10  # it stopped once a0's silence limit had passed
    assert any("agents/+/beat" in w for w in doc["warnings"]), doc["warnings"]
    assert any("agents/+/hello" in w for w in doc["warnings"]), doc["warnings"]
