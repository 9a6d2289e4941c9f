"""DelayProxy on loopback: the delay is added each way, bytes arrive intact, nothing lingers."""

from __future__ import annotations

import hashlib
import os
import select
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

import fedring
from fedring.lab.delay import THREAD_NAME, DelayProxy, parse_address
from fedring.transport.mosquitto import Mosquitto, MosquittoMissing, mosquitto_binary

LOCAL = "127.0.0.1"
REPO = str(Path(fedring.__file__).resolve().parent.parent)


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


@pytest.fixture
def echo() -> Iterator[int]:
    """An echo server on loopback; yields its port."""
    server = socketserver.ThreadingTCPServer((LOCAL, 0), _Echo)
    server.daemon_threads, server.block_on_close = True, False
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def round_trips(port: int, n: int = 5) -> list[float]:
    with socket.create_connection((LOCAL, port), timeout=5) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            s.sendall(b"x")
            assert s.recv(1) == b"x"
            times.append(time.perf_counter() - t0)
        return times


def echo_through(port: int, payload: bytes) -> tuple[bytes, float]:
    """Send `payload` (from a thread) and read the echo; returns it and the seconds taken."""
    with socket.create_connection((LOCAL, port), timeout=10) as s:
        t0 = time.perf_counter()
        sender = threading.Thread(target=s.sendall, args=(payload,))
        sender.start()
        got = bytearray()
        while len(got) < len(payload):
            chunk = s.recv(1 << 20)
            assert chunk, f"connection closed after {len(got)} of {len(payload)} bytes"
            got += chunk
        elapsed = time.perf_counter() - t0
        sender.join(10)
    return bytes(got), elapsed


def test_round_trip_costs_twice_the_delay(echo: int) -> None:
    with DelayProxy((LOCAL, 0), (LOCAL, echo), delay_ms=50) as proxy:
        assert proxy.address is not None
        times = round_trips(proxy.address[1])
    assert min(times) >= 0.100, times
    assert min(times) < 0.100 + 0.030, times  # noise only adds: the fastest sample is the fairest


def test_no_delay_is_fast(echo: int) -> None:
    with DelayProxy((LOCAL, 0), (LOCAL, echo), delay_ms=0) as proxy:
        assert proxy.address is not None
        times = round_trips(proxy.address[1])
    assert min(times) < 0.010, times


def test_jitter_stays_within_its_bounds(echo: int) -> None:
    with DelayProxy((LOCAL, 0), (LOCAL, echo), delay_ms=30, jitter_ms=20, seed=1) as proxy:
        assert proxy.address is not None
        times = round_trips(proxy.address[1], n=20)
    assert min(times) >= 0.020, times  # 2 × (30 − 20) ms
    assert min(times) < 0.060, times  # some trips came in under 2 × 30 ms ...
    assert max(times) - min(times) > 0.010, times  # ... and they vary


def test_bytes_arrive_intact_and_in_order(echo: int) -> None:
    payload = os.urandom(1 << 20)
    with DelayProxy((LOCAL, 0), (LOCAL, echo), delay_ms=5, jitter_ms=5) as proxy:
        assert proxy.address is not None
        got, _ = echo_through(proxy.address[1], payload)
    assert hashlib.sha256(got).hexdigest() == hashlib.sha256(payload).hexdigest()


def test_throughput_is_not_collapsed(echo: int) -> None:
    payload = os.urandom(5 << 20)
    with DelayProxy((LOCAL, 0), (LOCAL, echo), delay_ms=20) as proxy:
        assert proxy.address is not None
        got, elapsed = echo_through(proxy.address[1], payload)
    assert got == payload
    # 5 MB out and back through 2 × 20 ms: one chunk at a time it would take seconds.
    assert 0.040 <= elapsed < 0.5, elapsed


def test_small_buffer_pushes_back_without_losing_bytes(echo: int) -> None:
    payload = os.urandom(2 << 20)
    with DelayProxy((LOCAL, 0), (LOCAL, echo), delay_ms=2, max_buffer=64 * 1024) as proxy:
        assert proxy.address is not None
        got, _ = echo_through(proxy.address[1], payload)
    assert got == payload


def test_close_ends_connections_and_the_thread(echo: int) -> None:
    proxy = DelayProxy((LOCAL, 0), (LOCAL, echo), delay_ms=10).start()
    assert proxy.address is not None
    client = socket.create_connection(proxy.address, timeout=5)
    try:
        client.sendall(b"ping")
        assert client.recv(4) == b"ping"
        proxy.close()
        assert client.recv(1) == b""  # the proxy closed its side
    finally:
        client.close()
        proxy.close()  # idempotent
    assert not [t for t in threading.enumerate() if t.name == THREAD_NAME]
    with pytest.raises(OSError):
        socket.create_connection(proxy.address, timeout=1).close()


def test_unreachable_target_closes_the_client_and_keeps_serving(echo: int) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind((LOCAL, 0))
        dead = s.getsockname()[1]
    with DelayProxy((LOCAL, 0), (LOCAL, dead), delay_ms=0) as proxy:
        assert proxy.address is not None
        with socket.create_connection(proxy.address, timeout=5) as client:
            assert client.recv(1) == b""


def test_listen_on_a_busy_port_raises(echo: int) -> None:
    with pytest.raises(OSError):
        DelayProxy((LOCAL, echo), (LOCAL, echo), delay_ms=0).start()
    assert not [t for t in threading.enumerate() if t.name == THREAD_NAME]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"delay_ms": -1.0}, "delay_ms=-1.0 must be"),
        ({"delay_ms": float("nan")}, "delay_ms=nan must be"),
        ({"delay_ms": 10.0, "jitter_ms": 11.0}, "jitter_ms=11.0 must be in [0, delay_ms=10.0]"),
        ({"delay_ms": 10.0, "max_buffer": 10}, "max_buffer=10 must be"),
    ],
)
def test_bad_settings_name_the_field(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        DelayProxy((LOCAL, 0), (LOCAL, 1883), **kwargs)  # type: ignore[arg-type]


def test_bad_addresses_name_the_field() -> None:
    with pytest.raises(ValueError, match="target port=0 must be"):
        DelayProxy((LOCAL, 0), (LOCAL, 0), delay_ms=1)
    with pytest.raises(ValueError, match="listen port=70000 must be"):
        DelayProxy((LOCAL, 70000), (LOCAL, 1), delay_ms=1)
    assert parse_address("10.250.0.1:1883") == ("10.250.0.1", 1883)
    assert parse_address("[::1]:0") == ("::1", 0)
    for bad in ("1883", ":1883", "host:", "host:port", "host:70000"):
        with pytest.raises(ValueError, match="must be HOST:PORT"):
            parse_address(bad)


def _cli(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": REPO, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "fedring.lab.delay", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )


def test_cli_forwards_with_delay_and_exits_on_sigterm(echo: int) -> None:
    proc = _cli("--listen", f"{LOCAL}:0", "--target", f"{LOCAL}:{echo}", "--delay-ms", "20")
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 20)
        assert ready, "the proxy printed no address within 20 s"
        line = proc.stdout.readline()
        assert line.startswith(f"listening on {LOCAL}:"), line
        port = int(line.rsplit(":", 1)[1])
        times = round_trips(port)
        assert min(times) >= 0.040, times
        with socket.create_connection((LOCAL, port), timeout=5) as held:  # open at SIGTERM
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(5) == 0
            assert held.recv(1) == b""
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=5)  # reaps it and closes the pipes


def test_cli_rejects_bad_flags() -> None:
    proc = _cli("--listen", "nowhere", "--target", f"{LOCAL}:1", "--delay-ms", "1")
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 2 and "argument --listen: address 'nowhere'" in err, err
    proc = _cli("--listen", f"{LOCAL}:0", "--target", f"{LOCAL}:1", "--delay-ms", "-5")
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 2 and "delay_ms=-5.0 must be" in err, err


def _mosquitto_missing() -> str:
    try:
        mosquitto_binary()
    except MosquittoMissing as exc:
        return str(exc)
    return ""


def mqtt_round_trips(port: int, n: int = 5) -> list[float]:
    """Publish to a topic the same client subscribes to; seconds from publish to delivery."""
    connected, subscribed, delivered = threading.Event(), threading.Event(), threading.Event()
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"delay-{port}")
    client.on_connect = lambda *_: connected.set()
    client.on_subscribe = lambda *_: subscribed.set()
    client.on_message = lambda *_: delivered.set()
    client.connect(LOCAL, port)
    client.loop_start()
    try:
        assert connected.wait(5), "no CONNACK within 5 s"
        client.subscribe("fedring/lab/delay", qos=0)
        assert subscribed.wait(5), "no SUBACK within 5 s"
        times = []
        for _ in range(n):
            delivered.clear()
            t0 = time.perf_counter()
            client.publish("fedring/lab/delay", b"x", qos=0)
            assert delivered.wait(5), "the message did not come back within 5 s"
            times.append(time.perf_counter() - t0)
        return times
    finally:
        client.disconnect()
        client.loop_stop()


@pytest.mark.skipif(bool(_mosquitto_missing()), reason=_mosquitto_missing() or "present")
def test_mqtt_publish_to_delivery_through_the_proxy() -> None:
    with Mosquitto() as broker:
        direct = mqtt_round_trips(broker.port)
        with DelayProxy((LOCAL, 0), (LOCAL, broker.port), delay_ms=40) as proxy:
            assert proxy.address is not None
            delayed = mqtt_round_trips(proxy.address[1])
    # client → proxy → broker → proxy → client: the delay twice, on top of the direct time
    assert min(direct) < 0.020, direct
    assert min(delayed) >= 0.080, delayed
    assert min(delayed) < 0.080 + 0.040, delayed  # paho and the broker add their own hops
