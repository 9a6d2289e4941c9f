"""``/metrics``: the collector against hand-built feeds, the server's life, and a real
job over Mosquitto whose coordinator and agents are scraped and checked against its
summary (and the agent's own logged counters)."""

from __future__ import annotations

import ast
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from fedring.monitor import JobFeed
from fedring.monitor.prometheus import MetricsError, Probe, metrics_server, refusal, registry
from fedring.transport import topics
from fedring.transport.mosquitto import Mosquitto
from tests.monitor.conftest import MISSING
from tests.mqtt.conftest import Fleet, coordinator, job_toml, wait_for

GRAFANA = Path(__file__).parents[2] / "docs" / "operations" / "grafana-fedring.json"
URL = re.compile(r"metrics on (http://\S+/metrics)")
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    """Every sample of a scrape by (name, sorted labels), through prometheus_client's parser."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples}  # fmt: skip


def by_label(samples: Samples, name: str, label: str) -> dict[str, float]:
    return {dict(labels)[label]: v for (n, labels), v in samples.items() if n == name}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain")
        return str(reply.read().decode())


def scrape(url: str) -> Samples:
    return parse(fetch(url))


def declared(text: str) -> set[str]:
    """The series names a scrape declares, those with no sample yet included (no
    refusal so far): a counter family ``x`` is queried as ``x_total``."""
    names = set()
    for family in text_string_to_metric_families(text):
        names |= {family.name, f"{family.name}_total"} | {s.name for s in family.samples}
        names |= {f"{family.name}_{end}" for end in ("sum", "count")}
    return names


def _feed() -> JobFeed:
    feed = JobFeed(job="d1", rounds=10, agents=3)
    feed.members(["a0", "a1", "a2"], layout="ring")
    for r in range(1, 5):
        feed.round({"round": r, "loss": 2.0 / r, "lr": 0.1, "bytes_sent": 1000 * r,
                    "step_s": 0.25, "comm_s": 0.1, "compute_s": 0.15})  # fmt: skip
    feed.round({"round": 5, "loss": 0.3, "accuracy": 0.875, "bytes_sent": 5000})
    for name, n in (("frame_bad_mac", 3), ("frame_replayed", 1), ("job_refused", 2),
                    ("agent_lost", 1), ("inbox_full", 4)):  # fmt: skip
        feed.counters.add(name, n)
    return feed


# -- the collector, no network ------------------------------------------------------


def test_the_scrape_is_the_feed() -> None:
    feed = _feed()
    probe = Probe(info={"role": "coordinator"}, bytes_sent={"ring": 7, "control": 3},
                  link_bytes={"sent": 11, "received": 12}, queues={"control": 2, "data": 0},
                  queued_bytes=64, reformations=2)  # fmt: skip
    s = parse(generate_latest(registry(feed, lambda: probe)).decode())
    info = next(dict(k) for (n, k) in s if n == "fedring_job_info")
    assert info == {"job_id": "d1", "layout": "ring", "role": "coordinator"}
    assert by_label(s, "fedring_job_phase", "phase") == {
        "enrolling": 0.0, "training": 1.0, "done": 0.0, "failed": 0.0}  # fmt: skip
    assert value(s, "fedring_round") == 5 and value(s, "fedring_job_rounds") == 10
    assert value(s, "fedring_members") == 3 and value(s, "fedring_job_agents") == 3
    assert value(s, "fedring_accuracy") == 0.875 and value(s, "fedring_loss") == 0.3
    assert value(s, "fedring_member_bytes_sent") == 5000
    assert by_label(s, "fedring_events_total", "event") == feed.counters.snapshot()
    assert by_label(s, "fedring_refusals_total", "reason") == {
        "bad_mac": 3, "replayed": 1, "job_refused": 2}  # fmt: skip
    assert value(s, "fedring_reformations_total") == 2
    assert by_label(s, "fedring_bytes_sent_total", "kind") == {"ring": 7, "control": 3}
    assert by_label(s, "fedring_link_bytes_total", "direction") == {"sent": 11, "received": 12}
    assert by_label(s, "fedring_queue_depth", "queue") == {"control": 2, "data": 0}
    assert value(s, "fedring_queued_bytes") == 64
    assert value(s, "fedring_round_seconds_count") == 4  # rounds 1 -> 5
    assert value(s, "fedring_round_seconds_sum") >= 0
    assert {dict(k)["quantile"] for (n, k) in s if n == "fedring_round_seconds"} == {
        "0.5", "0.9", "0.99"}  # fmt: skip
    assert value(s, "process_resident_memory_bytes") > 1e6  # this test's own RSS


def test_each_scrape_reads_the_counters_again() -> None:
    """No second count: what the job counts after the registry is made shows."""
    feed = _feed()
    reg = registry(feed)
    feed.counters.add("frame_bad_mac", 10)
    feed.round({"round": 6, "loss": 0.2})
    feed.finish(ok=False)
    s = parse(generate_latest(reg).decode())
    assert value(s, "fedring_refusals_total", reason="bad_mac") == 13
    assert value(s, "fedring_round") == 6
    assert value(s, "fedring_job_phase", phase="failed") == 1
    assert ("fedring_reformations_total", ()) not in s  # no probe: not made up


def test_a_failing_probe_still_serves_the_feed() -> None:
    def probe() -> Probe:
        raise AttributeError("link closed")

    s = parse(generate_latest(registry(_feed(), probe)).decode())
    assert value(s, "fedring_round") == 5


def test_refusal_reasons() -> None:
    assert refusal("frame_bad_mac") == "bad_mac"
    assert refusal("code_refused") == "code_refused"
    assert refusal("checkpoint_bad_sha256") == "checkpoint_bad_sha256"
    assert refusal("bad_beat_field") == "bad_beat_field"
    assert refusal("agent_lost") is None and refusal("inbox_full") is None


# -- the server -------------------------------------------------------------------------


def test_the_server_serves_holds_and_frees_its_port() -> None:
    feed = _feed()
    scrapes: list[Samples] = []
    holding = threading.Event()
    start = 0.0

    def scrape_during_hold(url: str) -> None:
        holding.wait(5)
        time.sleep(0.3)  # inside the hold, after the block ended
        scrapes.append(scrape(url))

    with metrics_server(feed, 0, hold_s=1.5, announce=None) as port:
        url = f"http://127.0.0.1:{port}/metrics"
        assert value(scrape(url), "fedring_round") == 5
        reader = threading.Thread(target=scrape_during_hold, args=(url,))
        reader.start()
        feed.finish()
        holding.set()
        start = time.monotonic()
    held = time.monotonic() - start
    reader.join(5)
    assert held >= 1.5, held
    assert scrapes and value(scrapes[0], "fedring_job_phase", phase="done") == 1
    assert not [t.name for t in threading.enumerate() if "serve_forever" in t.name]
    with socket.socket() as sock:  # no listener is left: the port can be listened on again
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT, not a listener
        sock.bind(("127.0.0.1", port))
        sock.listen()
    with pytest.raises(OSError):
        scrape(url)


def test_a_port_in_use_is_an_error_naming_it() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with (pytest.raises(MetricsError, match=f"127.0.0.1:{port}"),
              metrics_server(JobFeed(), port, announce=None)):  # fmt: skip
            pass


def test_the_url_goes_to_announce() -> None:
    import io

    out = io.StringIO()
    with metrics_server(JobFeed(), 0, announce=out) as port:
        pass
    assert out.getvalue() == f"metrics on http://127.0.0.1:{port}/metrics\n"


def test_a_bad_metrics_port_is_a_usage_error() -> None:
    args = [sys.executable, "-m", "fedring", "coordinator", "run", "job.toml", "--broker",
            "mqtt://127.0.0.1:1", "--metrics-port", "70000"]  # fmt: skip
    done = subprocess.run(args, capture_output=True, timeout=60)
    assert done.returncode == 2 and "--metrics-port" in done.stderr.decode(), done.stderr


# -- a real job -------------------------------------------------------------------------


@dataclass
class Run:
    summary: dict
    coordinator: Samples
    agents: dict[str, Samples]  # after the job, the daemons still up
    stopped: dict[str, Samples]  # in the hold after SIGTERM: the daemons' final counts
    logged: dict[str, dict[str, int]]  # "agent X stopped; counters {...}" from their logs
    names: set[str]  # every series the coordinator and an agent declare


def _url(log: Path, timeout: float = 60.0) -> str:
    found: list[str] = []

    def seen() -> bool:
        found[:] = URL.findall(log.read_text(errors="replace")) if log.exists() else []
        return bool(found)

    wait_for(seen, timeout, f"the metrics URL in {log}")
    return found[-1]


@pytest.fixture(scope="module")
def run(broker: Mosquitto, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """A 40-round job of 2 agents, both sides serving /metrics; scraped after the end."""
    tmp = tmp_path_factory.mktemp("metrics")
    flags = ["--metrics-port", "0", "--metrics-hold", "20"]
    agents = ("m0", "m1")
    fleet = Fleet(broker.url, tmp / "logs", extra={a: flags for a in agents})
    proc = None
    try:
        for a in agents:
            fleet.start(a)
        job = job_toml(tmp, agents=2, rounds=40, compression="group-topk", density=0.05)
        out = tmp / "out"
        proc = coordinator(broker.url, job, out, "--metrics-port", "0",
                           "--metrics-hold", "20")  # fmt: skip
        url = _url(tmp / "out-coordinator.log")
        wait_for(lambda: (out / "summary.json").exists() and proc.poll() is None, 120,
                 "the summary, the coordinator still serving")  # fmt: skip
        wait_for(lambda: value(scrape(url), "fedring_job_phase", phase="done") == 1, 10,
                 "the coordinator's phase: done")  # fmt: skip
        summary = json.loads((out / "summary.json").read_text())
        coord = scrape(url)
        urls = {a: _url(fleet.logs / f"{a}.log") for a in agents}
        for a in agents:
            wait_for(lambda a=a: value(scrape(urls[a]), "fedring_job_phase", phase="done")
                     == 1, 20, f"{a}'s phase: done")  # fmt: skip
        live = {a: scrape(u) for a, u in urls.items()}
        # a refused frame on m0: counted, logged at exit, and on /metrics by its reason
        subprocess.run(["mosquitto_pub", "-p", str(broker.port), "-q", "1", "-t",
                        topics.inbox("noise", "m0", topics.COORDINATOR), "-s"],
                       input=b"\xc1" * 64, check=True, timeout=10)  # fmt: skip
        wait_for(lambda: by_label(scrape(urls["m0"]), "fedring_refusals_total", "reason"), 20,
                 "m0's refusal on /metrics")  # fmt: skip
        names = declared(fetch(url)) | declared(fetch(urls[agents[0]]))
        for a in agents:
            fleet.procs[a].send_signal(signal.SIGTERM)
        stopped, logged = {}, {}
        for a in agents:
            wait_for(lambda a=a: "stopped; counters" in fleet.log(a), 30, f"{a} stopped")
            stopped[a] = scrape(urls[a])  # in its hold: the daemon is done counting
            text = re.search(r"stopped; counters (\{.*\})", fleet.log(a))
            assert text is not None
            logged[a] = ast.literal_eval(text.group(1))
        yield Run(summary, coord, live, stopped, logged, names)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for p in fleet.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)


needs_mosquitto = pytest.mark.skipif(bool(MISSING), reason=MISSING or "mosquitto present")


@needs_mosquitto
def test_the_coordinator_scrape_matches_its_summary(run: Run) -> None:
    s, summary = run.coordinator, run.summary
    assert value(s, "fedring_round") == summary["rounds"] == 40
    assert by_label(s, "fedring_events_total", "event") == summary["coordinator_counters"]
    assert value(s, "fedring_reformations_total") == summary["reformations"]
    head = summary["members"][0]
    assert value(s, "fedring_member_bytes_sent") == summary["agent_bytes"][head]["ring"]
    assert value(s, "fedring_accuracy") == pytest.approx(summary["final_accuracy"])
    assert value(s, "fedring_members") == len(summary["members"]) == 2
    # everything the coordinator published up to its summary, and its goodbyes since
    sent = value(s, "fedring_link_bytes_total", direction="sent")
    before = summary["bytes_sent_by_coordinator"]
    assert before <= sent < before + 4096
    assert value(s, "fedring_link_bytes_total", direction="received") >= summary[
        "bytes_received_by_coordinator"]  # fmt: skip
    assert value(s, "fedring_round_seconds_count") == 39  # rows 1 -> 40
    assert value(s, "process_resident_memory_bytes") > 10e6
    info = next(dict(k) for (n, k) in s if n == "fedring_job_info")
    assert info["job_id"] == summary["job"] and info["role"] == "coordinator"


@needs_mosquitto
def test_an_agent_scrape_matches_its_bye_and_its_log(run: Run) -> None:
    summary = run.summary
    for agent, s in run.agents.items():
        sent = summary["agent_bytes"][agent]
        assert value(s, "fedring_round") == 40
        assert value(s, "fedring_bytes_sent_total", kind="ring") == sent["ring"]
        if "checkpoint" in sent:  # the summary's split
            assert value(s, "fedring_bytes_sent_total", kind="checkpoint") == sent["checkpoint"]
        kinds = by_label(s, "fedring_bytes_sent_total", "kind")
        assert sum(kinds.values()) >= sent["link"]  # the bye and later hellos come after
        events = by_label(s, "fedring_events_total", "event")
        for name, n in summary["agent_counters"][agent].items():  # the job's share of them
            assert events.get(name, 0) >= n, name
        info = next(dict(k) for (n, k) in s if n == "fedring_job_info")
        assert info == {"job_id": summary["job"], "layout": "ring", "role": "agent",
                        "agent": agent}  # fmt: skip
        assert set(by_label(s, "fedring_queue_depth", "queue")) >= {"control", "data"}
    for agent, s in run.stopped.items():
        assert by_label(s, "fedring_events_total", "event") == run.logged[agent]
    refused = by_label(run.stopped["m0"], "fedring_refusals_total", "reason")
    assert refused and refused == {k.removeprefix("frame_"): v for k, v in run.logged["m0"].items()
                                   if k.startswith("frame_")}, run.logged["m0"]  # fmt: skip


@needs_mosquitto
def test_the_grafana_dashboard_queries_only_real_metrics(run: Run) -> None:
    board = json.loads(GRAFANA.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 5
    names = set(re.findall(r"\b(?:fedring|process)_[a-z_]+\b", " ".join(exprs)))
    missing = names - run.names
    assert not missing, f"the dashboard queries metrics no scrape has: {sorted(missing)}"
    titles = " ".join(p["title"].lower() for p in board["panels"])
    for topic in ("round", "accuracy", "bytes", "refusals", "rss"):
        assert topic in titles, topic
