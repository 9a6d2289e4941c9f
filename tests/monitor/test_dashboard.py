"""The live dashboard: its HTTP server on a real socket, and the page in a real headless
Chromium (Debian's, driven by Playwright) against a real coordinator and agents."""

from __future__ import annotations

import http.client
import json
import math
import re
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from fedring.monitor import JobFeed
from fedring.monitor.dashboard import CSP, Dashboard, DashboardError, dashboard_server
from tests.monitor.conftest import MISSING
from tests.mqtt.conftest import Fleet, _env, job_toml, wait_for

CHROMIUM = Path("/usr/bin/chromium")
NO_CHROMIUM = "" if CHROMIUM.exists() else "Debian's chromium is not installed (/usr/bin/chromium)"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]  # fmt: skip
URL = re.compile(r"dashboard at (http://\S+/)")


def _feed() -> JobFeed:
    feed = JobFeed(job="d1", rounds=10, agents=3)
    feed.members(["a0", "a1", "a2"], "ring")
    for r in range(1, 5):
        feed.round({"round": r, "loss": 2.0 / r, "bytes_sent": 100 * r, "dense_bytes": 8000 * r,
                    "accuracy": 0.5 if r == 4 else None})  # fmt: skip
    return feed


@pytest.fixture
def board() -> Iterator[tuple[JobFeed, Dashboard]]:
    feed = _feed()
    with dashboard_server(feed, 0, announce=None) as started:
        yield feed, started


def get(board: Dashboard, path: str, method: str = "GET",
        headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:  # fmt: skip
    """One request with `path` sent exactly as written (no client-side normalising)."""
    conn = http.client.HTTPConnection(board.host, board.port, timeout=10)
    try:
        conn.request(method, path, headers=headers or {})
        res = conn.getresponse()
        return res.status, {k.lower(): v for k, v in res.getheaders()}, res.read()
    finally:
        conn.close()


def test_routes_answer_with_their_types_and_the_csp(board: tuple[JobFeed, Dashboard]) -> None:
    _, b = board
    want = {"/": "text/html", "/static/dashboard.js": "text/javascript",
            "/static/uPlot.iife.min.js": "text/javascript", "/static/dashboard.css": "text/css",
            "/api/state": "application/json"}  # fmt: skip
    for path, kind in want.items():
        status, headers, body = get(b, path)
        assert status == 200, path
        assert headers["content-type"].startswith(kind), (path, headers)
        assert headers["content-security-policy"] == CSP
        assert headers["x-content-type-options"] == "nosniff"
        assert int(headers["content-length"]) == len(body) > 0
    assert get(b, "/api/state")[1]["cache-control"] == "no-store"
    assert "'self'" in CSP and "http" not in CSP and "unsafe" not in CSP
    page = get(b, "/")[2].decode()
    assert "<script>" not in page and "style=" not in page  # nothing inline: the CSP allows none
    assert not re.search(r"(src|href)=\"(https?:)?//", page), "the page loads from elsewhere"


def test_state_is_the_feed_and_since_sends_the_newer_rows(
    board: tuple[JobFeed, Dashboard],
) -> None:
    feed, b = board
    feed.round({"round": 5, "loss": math.nan, "bytes_sent": 500})
    state = json.loads(get(b, "/api/state")[2])
    assert state["job"] == "d1" and state["round"] == 5 and state["members"] == ["a0", "a1", "a2"]
    assert [r["round"] for r in state["rows"]] == [1, 2, 3, 4, 5]
    assert state["rows"][-1]["loss"] is None  # NaN is no JSON: it comes as null
    newer = json.loads(get(b, "/api/state?since=3")[2])
    assert [r["round"] for r in newer["rows"]] == [4, 5] and newer["since"] == 3
    latest = json.loads(get(b, "/api/state?since=99")[2])
    assert latest["rows"] == [] and latest["round"] == 5
    assert latest["accuracy"] == 0.5 and latest["bytes_sent"] == 500  # from the older rows


@pytest.mark.parametrize("query", ["since=-1", "since=x", "since=1e3", "since=", "since=9&since=",
                                   "since=" + "9" * 40])  # fmt: skip
def test_a_malformed_since_is_refused_naming_it(
    board: tuple[JobFeed, Dashboard], query: str
) -> None:
    feed, b = board
    status, _, body = get(b, f"/api/state?{query}")
    assert status == 400
    assert json.loads(body)["field"] == "since"
    assert feed.counters.get("dashboard_bad_request") == 1


@pytest.mark.parametrize("path", [
    "/static/../../etc/passwd", "/static/..%2f..%2fetc%2fpasswd", "/static/%2e%2e/feed.py",
    "/static/../feed.py", "/static/", "/static", "/static//etc/passwd", "/etc/passwd",
    "//etc/passwd", "/static/dashboard.js/../../feed.py", "/api/state/../../etc/passwd",
    "/api", "/index.htm", "/static/index.html%00.js", "/static/__init__.py",
])  # fmt: skip
def test_other_paths_are_not_found(board: tuple[JobFeed, Dashboard], path: str) -> None:
    status, _, body = get(board[1], path)
    assert status == 404, path
    assert b"root:" not in body and b"import" not in body


def test_it_is_read_only(board: tuple[JobFeed, Dashboard]) -> None:
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        status, headers, _ = get(board[1], "/api/state", method=method)
        assert status == 405 and headers["allow"] == "GET, HEAD", method
    status, headers, body = get(board[1], "/api/state", method="HEAD")
    assert status == 200 and body == b"" and int(headers["content-length"]) > 0


def test_a_foreign_host_name_is_refused_on_loopback(board: tuple[JobFeed, Dashboard]) -> None:
    """A DNS-rebinding page asks with its own name: it gets no state."""
    _, b = board
    status, _, body = get(b, "/api/state", headers={"Host": f"evil.example:{b.port}"})
    assert status == 421 and json.loads(body)["field"] == "Host"
    for name in (f"localhost:{b.port}", "localhost:9999", f"127.0.0.1:{b.port}"):
        assert get(b, "/api/state", headers={"Host": name})[0] == 200, name


def test_a_failing_request_is_a_500_and_the_server_goes_on(
    board: tuple[JobFeed, Dashboard], monkeypatch: pytest.MonkeyPatch
) -> None:
    feed, b = board

    def broken() -> Any:
        raise RuntimeError("a bug in a view")

    monkeypatch.setattr(feed, "snapshot", broken)
    assert get(b, "/api/state")[0] == 500
    assert feed.counters.get("dashboard_error") == 1
    monkeypatch.undo()
    assert get(b, "/api/state")[0] == 200


def test_port_zero_announces_the_url_and_the_server_stops_at_exit() -> None:
    feed = _feed()
    with tempfile.TemporaryFile("w+") as out:
        with dashboard_server(feed, 0, announce=out) as b:
            assert b.port > 0 and get(b, "/")[0] == 200
        out.seek(0)
        assert out.read() == f"dashboard at http://127.0.0.1:{b.port}/\n"
    with pytest.raises(OSError), socket.create_connection((b.host, b.port), timeout=2):
        pass


def test_a_busy_port_is_a_clear_error() -> None:
    with dashboard_server(_feed(), 0, announce=None) as b:
        busy = pytest.raises(DashboardError, match=f"127.0.0.1:{b.port}")
        with busy, dashboard_server(_feed(), b.port, announce=None):
            pass


def test_coordinator_run_refuses_a_busy_dashboard_port(tmp_path: Path) -> None:
    job = job_toml(tmp_path, rounds=5)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = [sys.executable, "-m", "fedring", "coordinator", "run", str(job), "--broker",
                "mqtt://127.0.0.1:1", "--out", str(tmp_path / "out"),
                "--dashboard", str(port)]  # fmt: skip
        done = subprocess.run(args, capture_output=True, env=_env(), timeout=60)
    assert done.returncode == 2, done.stderr.decode()[-800:]
    assert f"--dashboard: dashboard cannot listen on 127.0.0.1:{port}" in done.stderr.decode()


# -- the page in a real browser, against a real job ---------------------------------------


def _dashboard_url(log: Path, proc: subprocess.Popen[bytes]) -> str:
    found: list[str] = []

    def announced() -> bool:
        assert proc.poll() is None, log.read_text()[-2000:]
        found[:] = URL.findall(log.read_text(errors="replace"))
        return bool(found)

    wait_for(announced, 60, "the dashboard's URL on the coordinator's stderr")
    return found[0]


@pytest.mark.skipif(bool(MISSING), reason=MISSING or "mosquitto present")
@pytest.mark.skipif(bool(NO_CHROMIUM), reason=NO_CHROMIUM or "chromium present")
def test_the_page_shows_a_running_job_in_chromium(fleet: Fleet, tmp_path: Path) -> None:
    job = job_toml(tmp_path, rounds=400, compression="group-topk", density=0.01)
    log = tmp_path / "coordinator.log"
    args = [sys.executable, "-m", "fedring", "coordinator", "run", str(job), "--broker",
            fleet.url, "--out", str(tmp_path / "out"), "--no-onnx", "--dashboard", "0"]  # fmt: skip
    with open(log, "wb") as err:
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=err, env=_env(),
                                start_new_session=True)  # fmt: skip
    try:
        url = _dashboard_url(log, proc)
        with chromium_page(url) as (page, problems):
            _check_page(page, problems, tmp_path)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


@contextmanager
def chromium_page(url: str) -> Iterator[tuple[Any, list[str]]]:
    """A page of Debian's headless Chromium at `url`, and the problems it logs (script
    errors, CSP refusals, requests to anywhere else)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            problems: list[str] = []
            page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(str(e)))
            page.on("request", lambda r: None if r.url.startswith(url) else problems.append(r.url))
            page.goto(url)
            yield page, problems
        finally:
            browser.close()


HOSTILE = "<img src=x onerror=\"document.title='pwned'\">"


@pytest.mark.skipif(bool(NO_CHROMIUM), reason=NO_CHROMIUM or "chromium present")
def test_the_page_follows_a_redone_round_and_shows_names_as_text() -> None:
    """A re-formed ring runs rounds again: the curve drops the old ones. Agent names and
    event texts from the network are text, never markup."""
    feed = JobFeed(job="j", rounds=50, agents=2)
    feed.members(["a0", HOSTILE], "ring")
    for r in range(1, 11):
        feed.round({"round": r, "loss": 1.0, "bytes_sent": 10 * r})
    points = "(n) => document.getElementById('chart-loss').dataset.points === String(n)"
    with dashboard_server(feed, 0, announce=None) as b, chromium_page(b.url) as (page, problems):
        page.wait_for_function(points, arg=10, timeout=20_000)
        feed.event("re-formed", HOSTILE)
        feed.round({"round": 6, "loss": 0.5, "bytes_sent": 60})  # rounds 6.. again
        page.wait_for_function(points, arg=6, timeout=20_000)
        for r in range(7, 9):
            feed.round({"round": r, "loss": 0.5, "bytes_sent": 10 * r})
        page.wait_for_function(points, arg=8, timeout=20_000)
        assert page.get_attribute("#round", "data-round") == "8"
        names = page.eval_on_selector_all("#ring text", "els => els.map(e => e.textContent)")
        assert HOSTILE in names, names
        assert HOSTILE in (page.text_content("#events") or "")
        assert page.locator("img").count() == 0 and "pwned" not in page.title()
        assert not problems, problems


def _check_page(page: Any, problems: list[str], tmp_path: Path) -> None:
    # functions, not expressions: the page's CSP forbids Playwright's eval of a string
    shown = "() => Number(document.querySelector('#round').dataset.round)"
    reached = "(n) => Number(document.querySelector('#round').dataset.round) >= n"
    points = "(id) => Number(document.getElementById(id).dataset.points)"
    page.wait_for_function(reached, arg=2, timeout=60_000)
    first, first_points = page.evaluate(shown), page.evaluate(points, "chart-loss")
    page.wait_for_function(reached, arg=first + 3, timeout=30_000)
    second, second_points = page.evaluate(shown), page.evaluate(points, "chart-loss")
    assert second > first and second_points > first_points, (first, second, first_points)
    assert page.evaluate(points, "chart-bytes") == second_points
    assert page.text_content("#phase") == "training"
    assert page.get_attribute("#link", "data-state") == "live"
    # the ring: four members, each a dot with its name, the head marked
    assert page.get_attribute("#ring", "data-members") == "4"
    names = page.eval_on_selector_all("#ring text", "els => els.map(e => e.textContent)")
    assert sorted(names) == ["a0", "a1", "a2", "a3"], names
    assert page.locator("#ring circle.member.head").count() == 1
    # the curves are drawn from the rows: uPlot's canvas is there and sized
    assert page.locator("#chart-loss canvas").bounding_box()["width"] > 200
    page.wait_for_function(reached, arg=12, timeout=30_000)  # an evaluation is in
    page.wait_for_function(r"() => /^[01]\.\d{4}$/.test(document.querySelector('#accuracy')"
                           ".textContent)")  # fmt: skip
    assert "fewer bytes" in (page.text_content("#ratio") or "")
    page.screenshot(path=str(tmp_path / "dashboard.png"))
    assert not problems, problems  # no script error, no CSP refusal, nothing fetched elsewhere


def test_simulate_serves_the_dashboard_while_it_runs(tmp_path: Path) -> None:
    args = [sys.executable, "-m", "fedring", "simulate", "--agents", "2", "--dataset", "digits",
            "--rounds", "3000", "--quiet", "--dashboard", "0"]  # fmt: skip
    log = tmp_path / "simulate.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=err, env=_env(),
                                start_new_session=True)  # fmt: skip
    try:
        url = _dashboard_url(log, proc)
        b = Dashboard("127.0.0.1", int(url.rsplit(":", 1)[1].strip("/")))
        rounds: list[int] = []

        def moved() -> bool:
            state = json.loads(get(b, "/api/state")[2])
            if state["round"] > 0:
                rounds.append(state["round"])
            return state["members"] == ["a0", "a1"] and len(rounds) > 1 and rounds[-1] > rounds[0]

        wait_for(moved, 60, "two reads of /api/state a round apart")
    finally:
        proc.kill()
        proc.wait(10)
