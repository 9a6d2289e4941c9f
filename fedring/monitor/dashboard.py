"""The live dashboard: a small read-only web page of a running job, served beside it.

    with dashboard_server(feed, port=8050) as board:   # port 0: a free one
        print(board.url)                                 # http://127.0.0.1:8050/
        run_the_job(feed)

Three kinds of route, all ``GET`` (or ``HEAD``), nothing else:

- ``/`` the page (``static/index.html``), which polls ``/api/state`` once a second;
- ``/static/NAME`` one of the files shipped in ``fedring/monitor/static`` (the page's
  script and style, and uPlot, vendored: nothing comes from a CDN);
- ``/api/state`` the feed's `Snapshot.as_json`; ``?since=R`` sends only the rows
  after round R, so a page that already holds the curve fetches a few rows a poll.

Safety: it binds to loopback unless told otherwise (a job's members and curves are
not for every host on the network; reach it from elsewhere over an SSH tunnel); it
changes nothing in the job; a static name must be one of the shipped files (no path
is ever joined from a request); the Content-Security-Policy lets the page load only
its own files; on a loopback bind a request whose ``Host`` is not a loopback name is
refused (a DNS-rebinding page cannot read the job). A failing request is logged and
answered 500; it never reaches the job's thread.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import logging
import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any, TextIO
from urllib.parse import parse_qs, urlsplit

from fedring.monitor.feed import JobFeed

log = logging.getLogger(__name__)

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; "
       "frame-ancestors 'none'")  # fmt: skip
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8", ".md": "text/plain; charset=utf-8",
         ".svg": "image/svg+xml", ".LICENSE": "text/plain; charset=utf-8"}  # fmt: skip
LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}


class DashboardError(Exception):
    """The dashboard cannot start (a bad host, a port in use); the message names them."""


@dataclass(frozen=True)
class Asset:
    body: bytes
    content_type: str


def _assets() -> dict[str, Asset]:
    """The shipped static files by name, read once: requests only look names up here."""
    folder = resources.files("fedring.monitor") / "static"
    assets = {}
    for item in folder.iterdir():
        suffix = next((s for s in TYPES if item.name.endswith(s)), None)
        if item.is_file() and suffix is not None:
            assets[item.name] = Asset(item.read_bytes(), TYPES[suffix])
    return assets


def state_json(feed: JobFeed, since: int | None = None) -> dict[str, Any]:
    """What ``/api/state`` serves: the snapshot, its rows after round `since` if given
    (the header's figures still come from every row: the last accuracy may be older)."""
    snap = feed.snapshot()
    if since is None:
        return snap.as_json()
    newer = tuple(r for r in snap.rows if r["round"] > since)
    state = dataclasses.replace(snap, rows=newer).as_json()  # only these are converted
    eta = snap.eta_s
    state.update(accuracy=snap.accuracy, bytes_sent=snap.bytes_sent, since=since,
                 eta_s=None if eta is None else round(eta, 1))  # fmt: skip
    return state


def _since(query: str) -> int | None:
    """``since=R`` (R >= 0) from a query string; ValueError naming it when malformed."""
    values = parse_qs(query, keep_blank_values=True).get("since")
    if not values:
        return None
    text = values[-1]
    if not text.isdigit() or len(text) > 12:
        raise ValueError(f"since must be a round number >= 0, got {text[:40]!r}")
    return int(text)


class Handler(BaseHTTPRequestHandler):
    """One request. The server carries the feed, the assets and the host check."""

    server: DashboardHTTPServer
    server_version = "fedring-dashboard"
    sys_version = ""

    def do_GET(self) -> None:  # http.server's names
        self._answer(head=False)

    def do_HEAD(self) -> None:
        self._answer(head=True)

    def _refuse_method(self) -> None:
        self._send(HTTPStatus.METHOD_NOT_ALLOWED, b"read-only: GET or HEAD\n",
                   "text/plain; charset=utf-8", extra={"Allow": "GET, HEAD"})  # fmt: skip

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse_method

    def _answer(self, head: bool) -> None:
        try:
            self._route(head)
        except Exception:  # a view's bug must not end the job, nor leave the client hanging
            log.exception("dashboard: %s %s failed", self.command, self.path[:200])
            self.server.feed.counters.add("dashboard_error")
            self._send(HTTPStatus.INTERNAL_SERVER_ERROR, b"internal error\n",
                       "text/plain; charset=utf-8", head=head)  # fmt: skip

    def _route(self, head: bool) -> None:
        if not self.server.host_allowed(self.headers.get("Host", "")):
            self._bad("Host", self.headers.get("Host", ""), HTTPStatus.MISDIRECTED_REQUEST, head)
            return
        url = urlsplit(self.path)
        if url.path in ("/", "/index.html"):
            self._asset("index.html", head, cache="no-cache")
        elif url.path.startswith("/static/"):
            self._asset(url.path.removeprefix("/static/"), head, cache="max-age=300")
        elif url.path == "/api/state":
            try:
                since = _since(url.query)
            except ValueError as exc:
                self._bad("since", str(exc), HTTPStatus.BAD_REQUEST, head)
                return
            body = json.dumps(state_json(self.server.feed, since), allow_nan=False)
            self._send(HTTPStatus.OK, body.encode(), "application/json", head=head)
        else:
            self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain; charset=utf-8",
                       head=head)  # fmt: skip

    def _asset(self, name: str, head: bool, cache: str) -> None:
        asset = self.server.assets.get(name)  # a name, never a path: no '..' can reach out
        if asset is None:
            self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain; charset=utf-8",
                       head=head)  # fmt: skip
            return
        self._send(HTTPStatus.OK, asset.body, asset.content_type, head=head, cache=cache)

    def _bad(self, field: str, detail: str, status: HTTPStatus, head: bool) -> None:
        log.warning("dashboard: refused %s from %s: %s %r", field, self.client_address[0],
                    status.phrase, detail[:200])  # fmt: skip
        self.server.feed.counters.add("dashboard_bad_request")
        body = json.dumps({"error": status.phrase, "field": field, "detail": detail[:200]})
        self._send(status, body.encode(), "application/json", head=head)

    def _send(self, status: HTTPStatus, body: bytes, content_type: str, *, head: bool = False,
              cache: str = "no-store", extra: dict[str, str] | None = None) -> None:  # fmt: skip
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", cache)
        self.send_header("Content-Security-Policy", CSP)
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        for key, value in (extra or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("dashboard: %s " + format, self.client_address[0], *args)


class DashboardHTTPServer(ThreadingHTTPServer):
    daemon_threads = True  # a slow browser never holds the job's exit

    def __init__(self, feed: JobFeed, host: str, port: int) -> None:
        self.feed, self.assets = feed, _assets()
        self.loopback = _is_loopback(host)
        if ":" in host:
            self.address_family = socket.AF_INET6
        super().__init__((host, port), Handler)

    def host_allowed(self, host_header: str) -> bool:
        """On a loopback bind, only a loopback name may be asked for (DNS rebinding)."""
        if not self.loopback:
            return True
        name = host_header.rsplit(":", 1)[0] if not host_header.endswith("]") else host_header
        return name.strip("[]").lower() in LOOPBACK_NAMES

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("dashboard: connection from %s broke", client_address, exc_info=True)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Dashboard:
    """A started dashboard: where to point a browser."""

    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"


@contextmanager
def dashboard_server(feed: JobFeed, port: int, host: str = "127.0.0.1",
                     announce: TextIO | None = sys.stderr) -> Iterator[Dashboard]:  # fmt: skip
    """Serve the dashboard of `feed` on `host`:`port` (0: a free port) until the block
    ends. Its URL is logged and written to `announce` (stderr; None: not written).

    Raises
    ------
    DashboardError
        The port or host cannot be bound (in use, not an address of this machine).
    """
    if not 0 <= port <= 65535:
        raise DashboardError(f"dashboard port must be 0..65535, got {port}")
    try:
        server = DashboardHTTPServer(feed, host, port)
    except OSError as exc:
        raise DashboardError(
            f"dashboard cannot listen on {host}:{port}: {exc.strerror or exc}"
        ) from None
    board = Dashboard(host, int(server.server_address[1]))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                              name="dashboard", daemon=True)  # fmt: skip
    thread.start()
    log.info("dashboard at %s", board.url)
    if announce is not None:
        print(f"dashboard at {board.url}", file=announce, flush=True)
    try:
        yield board
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
