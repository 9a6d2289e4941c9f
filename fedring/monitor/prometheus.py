"""The Prometheus endpoint of a job: ``/metrics`` read from its `JobFeed` at each scrape.

    with metrics_server(feed, 9100, "127.0.0.1", probe=lambda: Probe(info={"role": "agent"})):
        run_the_job(feed)

Nothing here counts anything: `FeedCollector` turns the feed's snapshot (its rows,
members, phase and the job's own `Counters`) and the runner's `Probe` (its link's bytes
and queues, its re-formations) into metric families when Prometheus asks, so a scrape
always agrees with the job's summary. It has its own `CollectorRegistry` (with the
standard ``process_*`` metrics: RSS, CPU, open files) and never touches the global one.

Why `hold_s`: Prometheus scrapes every 15 s or so; a job that ends between two
scrapes would never show its last round. `metrics_server` keeps answering for
`hold_s` seconds after the job is done, then stops its thread and frees the port.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TextIO

from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from fedring.monitor.feed import JobFeed, Snapshot

log = logging.getLogger(__name__)
PHASES = ("enrolling", "training", "done", "failed")
QUANTILES = (0.5, 0.9, 0.99)
WINDOW = 100  # the round-time quantiles are over the latest this many rounds
ROW_GAUGES = {  # a row's field -> (metric, help)
    "loss": ("fedring_loss", "Training loss of the latest round."),
    "lr": ("fedring_learning_rate", "Learning rate of the latest round."),
    "compression_error": ("fedring_compression_error",
                          "Relative compression error of the latest round."),
}  # fmt: skip
STEP_PARTS = ("step_s", "comm_s", "compute_s")  # the reporting member's own times


@dataclass(frozen=True)
class Probe:
    """What the feed does not hold, read from the runner's own objects at each scrape.

    Every field is optional: a runner fills what it has.
    """

    info: Mapping[str, str] = field(default_factory=dict)  # role, agent id: job_info labels
    bytes_sent: Mapping[str, int] = field(default_factory=dict)  # the job's, by kind
    link_bytes: Mapping[str, int] = field(default_factory=dict)  # "sent"/"received", lifetime
    queues: Mapping[str, int] = field(default_factory=dict)  # queue -> items waiting
    queued_bytes: int | None = None  # payload bytes waiting in all of them
    reformations: int | None = None


def refusal(name: str) -> str | None:
    """The reason a counter counts a refusal (None: not a refusal).

    ``frame_<reason>`` (a frame the wire refused) gives ``<reason>``; names of the
    ``*_refused`` / ``bad_*`` / ``*_bad_*`` kinds give themselves.
    """
    if name.startswith("frame_"):
        return name.removeprefix("frame_")
    if name.endswith("_refused") or name.startswith("bad_") or "_bad_" in name:
        return name
    return None


class FeedCollector(Collector):
    """Metric families of `feed` (and `probe`, if given), built at each scrape."""

    def __init__(self, feed: JobFeed, probe: Callable[[], Probe] | None = None) -> None:
        self.feed, self.probe = feed, probe

    def collect(self) -> Iterable[Metric]:
        snap = self.feed.snapshot()
        probe = self._probe()
        yield from _job(snap, probe)
        yield from _progress(snap)
        yield from _round_time(snap)
        yield from _counts(snap, probe)
        yield from _traffic(snap, probe)

    def _probe(self) -> Probe:
        if self.probe is None:
            return Probe()
        try:
            return self.probe()
        except Exception:  # a runner mid-teardown: serve the feed's part, not a 500
            log.debug("metrics probe failed", exc_info=True)
            return Probe()


def _gauge(name: str, doc: str, value: float, unit: str = "") -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value, unit=unit)


def _job(snap: Snapshot, probe: Probe) -> Iterator[Metric]:
    info = InfoMetricFamily("fedring_job", "The job this process runs.")
    # job_id, not job: Prometheus gives every target a `job` label of its own
    info.add_metric([], {"job_id": snap.job, "layout": snap.layout, **probe.info})
    yield info
    phase = GaugeMetricFamily("fedring_job_phase", "1 for the job's current phase.",
                              labels=["phase"])  # fmt: skip
    for name in PHASES:
        phase.add_metric([name], 1.0 if snap.phase == name else 0.0)
    yield phase
    yield _gauge("fedring_job_rounds", "Rounds the job runs in all.", snap.rounds)
    yield _gauge("fedring_job_agents", "Agents the job runs on.", snap.agents)
    yield _gauge("fedring_members", "Members of the current ring (or star).", len(snap.members))
    yield _gauge("fedring_agents_online", "Agents online (enrolment) or in the ring.", snap.online)
    yield _gauge("fedring_elapsed_seconds", "Seconds since the feed began.", snap.elapsed_s)


def _progress(snap: Snapshot) -> Iterator[Metric]:
    yield _gauge("fedring_round", "The latest round with a metrics row (0: none yet).", snap.round)
    if snap.accuracy is not None:
        yield _gauge("fedring_accuracy", "Latest evaluated test accuracy.", snap.accuracy)
    last = snap.last
    for key, (name, doc) in ROW_GAUGES.items():
        value = last.get(key)
        if isinstance(value, int | float):
            yield _gauge(name, doc, float(value))


def _round_time(snap: Snapshot) -> Iterator[Metric]:
    """The time between rows as the feed saw them arrive: the job's pace. Sum and count
    span the first row kept to the last (the feed thins old rows but keeps the first)."""
    stamped = [r for r in snap.rows if isinstance(r.get("_t"), float)]
    gaps = [(b["_t"] - a["_t"]) / max(int(b["round"]) - int(a["round"]), 1)
            for a, b in zip(stamped[-WINDOW - 1:], stamped[-WINDOW:], strict=False)]  # fmt: skip
    if gaps:
        yield _gauge("fedring_last_round_seconds", "Seconds the latest round took.", gaps[-1])
    summary = SummaryMetricFamily("fedring_round_seconds", "Seconds per round; quantiles "
                                  f"over the latest {WINDOW} rounds.", labels=[])  # fmt: skip
    ordered = sorted(gaps)
    for q in QUANTILES if ordered else ():
        at = ordered[min(int(q * len(ordered)), len(ordered) - 1)]
        summary.samples.append(Sample("fedring_round_seconds", {"quantile": str(q)}, at))
    count = int(stamped[-1]["round"]) - int(stamped[0]["round"]) if len(stamped) > 1 else 0
    total = stamped[-1]["_t"] - stamped[0]["_t"] if count else 0.0
    summary.add_metric([], count_value=count, sum_value=total)
    yield summary
    parts = GaugeMetricFamily("fedring_step_seconds", "The reporting member's latest "
                              "round: whole step, communication, computation.",
                              labels=["part"])  # fmt: skip
    for key in STEP_PARTS:
        value = snap.last.get(key)
        if isinstance(value, int | float):
            parts.add_metric([key.removesuffix("_s")], float(value))
    yield parts


def _counts(snap: Snapshot, probe: Probe) -> Iterator[Metric]:
    events = CounterMetricFamily("fedring_events", "Every count of the job's counters "
                                 "(the summary's counters), by name.",
                                 labels=["event"])  # fmt: skip
    refusals = CounterMetricFamily("fedring_refusals", "Refused frames and messages, "
                                   "by reason.", labels=["reason"])  # fmt: skip
    for name, value in sorted(snap.counters.items()):
        events.add_metric([name], value)
        reason = refusal(name)
        if reason is not None:
            refusals.add_metric([reason], value)
    yield events
    yield refusals
    if probe.reformations is not None:
        yield CounterMetricFamily("fedring_reformations", "Times the ring was re-formed.",
                                  value=probe.reformations)  # fmt: skip


def _traffic(snap: Snapshot, probe: Probe) -> Iterator[Metric]:
    yield _gauge("fedring_member_bytes_sent", "Bytes the reporting member (the ring's "
                 "head, or this agent) sent in the job's ring, from its rows.",
                 snap.bytes_sent)  # fmt: skip
    if probe.bytes_sent:
        yield _labelled(CounterMetricFamily("fedring_bytes_sent", "Bytes this process sent "
                        "in the current job, by kind.", labels=["kind"]), probe.bytes_sent)
    if probe.link_bytes:
        yield _labelled(CounterMetricFamily("fedring_link_bytes", "Bytes through this "
                        "process's broker connection since it started.",
                        labels=["direction"]), probe.link_bytes)  # fmt: skip
    if probe.queues:
        yield _labelled(GaugeMetricFamily("fedring_queue_depth", "Items waiting in an "
                        "incoming queue.", labels=["queue"]), probe.queues)
    if probe.queued_bytes is not None:
        yield _gauge("fedring_queued_bytes", "Payload bytes waiting in the incoming queues.",
                     probe.queued_bytes)  # fmt: skip


def _labelled(family: CounterMetricFamily | GaugeMetricFamily,
              values: Mapping[str, float]) -> Metric:  # fmt: skip
    """`family` (one label) with a sample for each of `values`, in label order."""
    for label, value in sorted(values.items()):
        family.add_metric([label], value)
    return family


def registry(feed: JobFeed, probe: Callable[[], Probe] | None = None) -> CollectorRegistry:
    """A registry of its own: the feed's metrics and this process's ``process_*``."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(FeedCollector(feed, probe))
    ProcessCollector(registry=reg)  # RSS, CPU seconds, open files (Linux's /proc)
    return reg


class MetricsError(Exception):
    """The endpoint cannot start (a bad host, a port in use); the message names them."""


@contextmanager
def metrics_server(feed: JobFeed, port: int, host: str = "127.0.0.1", *,
                   probe: Callable[[], Probe] | None = None, hold_s: float = 0.0,
                   announce: TextIO | None = sys.stderr) -> Iterator[int]:  # fmt: skip
    """Serve ``/metrics`` on `host`:`port` (0: a free port) while the block runs, then
    `hold_s` seconds more; yields the port. Its URL is written to `announce` (stderr;
    None: not written). The server's thread is stopped and its socket closed
    on the way out: the port is free when the block is left."""
    try:
        server, thread = start_http_server(port, addr=host, registry=registry(feed, probe))
    except OSError as exc:  # in use, or an address this host does not have
        raise MetricsError(
            f"metrics cannot listen on {host}:{port}: {exc.strerror or exc}"
        ) from None
    bound = int(server.server_address[1])
    url = f"http://{host}:{bound}/metrics"
    if announce is not None:
        announce.write(f"metrics on {url}\n")
        announce.flush()
    try:
        yield bound
        if hold_s > 0:
            log.info("metrics held for %g s after the job", hold_s)
            time.sleep(hold_s)  # Ctrl-C ends the hold at once
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5.0)
