"""TLS on a real Mosquitto: a certificate problem is a fast, named `BrokerTlsError`.

Certificates are made per module with openssl (a CA, the broker's certificate for
127.0.0.1, a client certificate, and a second, untrusted CA), as docs/deploy.md shows.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedring.cli import app
from fedring.transport.mosquitto import Mosquitto, TlsListener
from fedring.transport.mqtt import BrokerConfig, BrokerTlsError, MqttLink
from tests.mqtt.conftest import MISSING

pytestmark = [
    pytest.mark.skipif(bool(MISSING), reason=MISSING or "mosquitto present"),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed"),
]
EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _ca(d: Path, name: str) -> None:
    subprocess.run(["openssl", "req", "-x509", *EC, "-days", "2", "-keyout", d / f"{name}.key",
                    "-out", d / f"{name}.crt", "-subj", f"/CN={name}"],
                   check=True, capture_output=True)  # fmt: skip


def _signed(d: Path, name: str, ca: str, san: str) -> None:
    csr = subprocess.run(["openssl", "req", *EC, "-keyout", d / f"{name}.key", "-subj",
                          f"/CN={name}", "-addext", f"subjectAltName={san}"],
                         check=True, capture_output=True).stdout  # fmt: skip
    subprocess.run(["openssl", "x509", "-req", "-CA", d / f"{ca}.crt", "-CAkey", d / f"{ca}.key",
                    "-CAcreateserial", "-days", "2", "-copy_extensions", "copy",
                    "-out", d / f"{name}.crt"],
                   input=csr, check=True, capture_output=True)  # fmt: skip


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("certs")
    _ca(d, "ca")
    _ca(d, "rogue")
    _signed(d, "server", "ca", "IP:127.0.0.1")
    _signed(d, "client", "ca", "DNS:a1")
    return d


@pytest.fixture(scope="module")
def tls_broker(certs: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto]:
    tls = TlsListener(certs / "ca.crt", certs / "server.crt", certs / "server.key",
                      require_certificate=True)  # fmt: skip
    with Mosquitto(tls=tls, workdir=tmp_path_factory.mktemp("tls")) as b:
        yield b


def _cfg(b: Mosquitto, certs: Path, ca: str = "ca", client: bool = True) -> BrokerConfig:
    files = {"cert": str(certs / "client.crt"), "key": str(certs / "client.key")} if client else {}
    return BrokerConfig.parse(b.url, ca=str(certs / f"{ca}.crt"), **files)


def test_a_trusted_client_certificate_connects(tls_broker: Mosquitto, certs: Path) -> None:
    link = MqttLink(_cfg(tls_broker, certs), "a1").connect()
    link.close()


def test_an_untrusted_broker_certificate_is_a_fast_tls_error(
    tls_broker: Mosquitto, certs: Path
) -> None:
    start = time.monotonic()
    with pytest.raises(BrokerTlsError, match=r"CERTIFICATE_VERIFY_FAILED.*--ca '.*rogue\.crt'"):
        MqttLink(_cfg(tls_broker, certs, ca="rogue"), "a1").connect()
    assert time.monotonic() - start < 3  # not the 15 s "no answer from broker"


def test_a_missing_client_certificate_is_a_fast_tls_error(
    tls_broker: Mosquitto, certs: Path
) -> None:
    start = time.monotonic()
    with pytest.raises(BrokerTlsError, match=r"(?i)certificate.*--cert and --key"):
        MqttLink(_cfg(tls_broker, certs, client=False), "a1").connect()
    assert time.monotonic() - start < 3


def test_a_missing_ca_file_is_named(tls_broker: Mosquitto) -> None:
    cfg = BrokerConfig.parse(tls_broker.url, ca="/nonexistent/ca.crt")
    with pytest.raises(BrokerTlsError, match=r"--ca '/nonexistent/ca\.crt': no such file"):
        MqttLink(cfg, "a1").connect()


@pytest.mark.parametrize("option", ["--ca", "--cert", "--key"])
def test_the_cli_names_a_missing_tls_file_and_exits_2(option: str) -> None:
    args = ["agent", "--broker", "mqtts://127.0.0.1:1", "--id", "a1", option, "/nonexistent"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert option in result.output and "/nonexistent" in result.output
    assert "Traceback" not in result.output


def test_a_client_certificate_from_an_untrusted_ca_is_named_as_such(
    tls_broker: Mosquitto, certs: Path
) -> None:
    """Both --cert and --key given, signed by a CA the broker does not trust: the hint
    names the certificate, not "give --cert and --key" (issue 27)."""
    _signed(certs, "rogue-client", "rogue", "DNS:a1")
    cfg = BrokerConfig.parse(tls_broker.url, ca=str(certs / "ca.crt"),
                             cert=str(certs / "rogue-client.crt"),
                             key=str(certs / "rogue-client.key"))  # fmt: skip
    start = time.monotonic()
    with pytest.raises(BrokerTlsError) as refused:
        MqttLink(cfg, "a1").connect()
    text = str(refused.value)
    assert "give --cert and --key" not in text, text
    assert "rogue-client.crt" in text and "trust" in text, text
    assert time.monotonic() - start < 3
