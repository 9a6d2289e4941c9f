"""Latency in user space: a TCP forwarder that holds every chunk for a fixed time.

The lab's kernel has no netem, so a link's delay is added here instead: an agent
connects to a `DelayProxy` in its own namespace, and the proxy forwards to the
broker. Each chunk read from one side is written to the other ``delay_ms``
(± uniform ``jitter_ms``) after it arrived, in both directions, so a round trip
through the proxy costs ``2 * delay_ms`` more. Chunks are pipelined (a queue per
direction), so the proxy adds latency without capping throughput; what it holds
per direction (rate × delay) is bounded by ``max_buffer`` bytes, after which it
stops reading and TCP pushes back on the sender.

It delays TCP through the proxy only, per chunk rather than per packet: bytes are
never reordered, and jitter never lets a chunk overtake the one before it (release
times only move forward, so jitter slightly raises the mean delay).

In a test or a script::

    with DelayProxy(("127.0.0.1", 0), ("127.0.0.1", 1883), delay_ms=20) as proxy:
        host, port = proxy.address  # connect here instead of to the broker

As a process (the lab starts one per agent namespace and stops it by PID)::

    ip netns exec NS python -m fedring.lab.delay \\
        --listen 127.0.0.1:1883 --target 10.250.0.1:1883 --delay-ms 20

It prints ``listening on HOST:PORT`` once it accepts connections and exits on
SIGTERM or SIGINT, closing every connection. It leaves no kernel state behind.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import signal
import sys
import threading
from collections.abc import Callable, Sequence

Address = tuple[str, int]

CHUNK = 64 * 1024
CONNECT_TIMEOUT_S = 10.0
THREAD_NAME = "fedring-delay-proxy"


class DelayProxy:
    """Forward TCP from `listen` to `target`, each chunk held ``delay_ms`` ± ``jitter_ms``.

    Parameters
    ----------
    listen, target
        ``(host, port)``; port 0 in `listen` picks a free port (see `address`).
    delay_ms
        One-way delay added in each direction, ≥ 0.
    jitter_ms
        Half-width of a uniform spread around `delay_ms`, in ``[0, delay_ms]``.
    seed
        Seeds the jitter of each connection and direction.
    max_buffer
        Bytes held per direction before the proxy stops reading (back-pressure).
    """

    def __init__(
        self,
        listen: Address,
        target: Address,
        delay_ms: float,
        jitter_ms: float = 0.0,
        seed: int = 0,
        max_buffer: int = 32 * 1024 * 1024,
    ) -> None:
        self.listen = _check_address(listen, "listen", allow_port_0=True)
        self.target = _check_address(target, "target", allow_port_0=False)
        if not (math.isfinite(delay_ms) and delay_ms >= 0):
            raise ValueError(f"delay_ms={delay_ms} must be a finite number >= 0")
        if not (math.isfinite(jitter_ms) and 0 <= jitter_ms <= delay_ms):
            raise ValueError(f"jitter_ms={jitter_ms} must be in [0, delay_ms={delay_ms}]")
        if max_buffer < CHUNK:
            raise ValueError(f"max_buffer={max_buffer} must be >= {CHUNK}")
        self.delay_s, self.jitter_s = delay_ms / 1000, jitter_ms / 1000
        self.seed, self.max_buffer = seed, max_buffer
        self.address: Address | None = None  # where it listens, once serving
        self._connections: set[asyncio.Task[None]] = set()
        self._accepted = 0
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    async def serve(
        self, stop: asyncio.Event, on_ready: Callable[[Address], None] | None = None
    ) -> None:
        """Accept and forward until `stop` is set, then close every connection."""
        server = await asyncio.start_server(self._handle, *self.listen, reuse_address=True)
        try:
            host, port = server.sockets[0].getsockname()[:2]
            self.address = (host, port)
            if on_ready:
                on_ready(self.address)
            await stop.wait()
        finally:
            server.close()
            for task in list(self._connections):
                task.cancel()
            await asyncio.gather(*self._connections, return_exceptions=True)
            await server.wait_closed()

    def start(self, timeout: float = 5.0) -> DelayProxy:
        """Serve from a background thread; return once it accepts connections."""
        if self._thread is not None:
            raise RuntimeError("DelayProxy already started")
        self._thread = threading.Thread(target=self._thread_main, name=THREAD_NAME, daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            self.close()
            raise RuntimeError(f"delay proxy did not listen on {self.listen} within {timeout} s")
        if self._error is not None:
            self.close()
            raise self._error
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Close every connection and the listener, and join the thread."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            with contextlib.suppress(RuntimeError):  # the loop already ended
                loop.call_soon_threadsafe(stop.set)
        thread.join(timeout)
        if thread.is_alive():
            raise RuntimeError(f"delay proxy thread still running after {timeout} s")

    def run(self) -> None:
        """Serve in this (main) thread until SIGTERM or SIGINT; print the address when ready."""

        async def main() -> None:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            await self.serve(stop, lambda a: print(f"listening on {a[0]}:{a[1]}", flush=True))

        asyncio.run(main())

    def __enter__(self) -> DelayProxy:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.close()

    def _thread_main(self) -> None:
        async def main() -> None:
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            await self.serve(self._stop, lambda _: self._ready.set())

        try:
            asyncio.run(main())
        except OSError as exc:  # cannot listen: start() re-raises it in the caller
            self._error = exc
        finally:
            self._ready.set()

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None  # a callback of start_server always runs in a task
        self._connections.add(task)
        n, self._accepted = self._accepted, self._accepted + 1
        writers = [client_w]
        try:
            upstream_r, upstream_w = await asyncio.wait_for(
                asyncio.open_connection(*self.target), CONNECT_TIMEOUT_S
            )
            writers.append(upstream_w)
            async with asyncio.TaskGroup() as group:
                group.create_task(self._pipe(f"{n}/up").run(client_r, upstream_w))
                group.create_task(self._pipe(f"{n}/down").run(upstream_r, client_w))
        except* (OSError, TimeoutError):
            pass  # a peer reset or the target refused: this connection ends, the proxy goes on
        except* asyncio.CancelledError:
            pass  # closed by close(): 3.11 start_server would log a cancelled handler as an error
        finally:
            for writer in writers:
                writer.close()
            self._connections.discard(task)

    def _pipe(self, name: str) -> _Pipe:
        rng = random.Random(f"{self.seed}/{name}")
        return _Pipe(self.delay_s, self.jitter_s, rng, self.max_buffer)


class _Pipe:
    """One direction of one connection: a reader that stamps chunks, a writer that waits."""

    def __init__(self, delay_s: float, jitter_s: float, rng: random.Random, max_buffer: int):
        self.delay_s, self.jitter_s, self.rng = delay_s, jitter_s, rng
        self.max_buffer = max_buffer
        self.queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        self.held = 0
        self.room = asyncio.Event()
        self.room.set()

    async def run(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async with asyncio.TaskGroup() as group:
            group.create_task(self._take(reader))
            group.create_task(self._give(writer))

    async def _take(self, reader: asyncio.StreamReader) -> None:
        loop = asyncio.get_running_loop()
        last = 0.0
        while True:
            data = await reader.read(CHUNK)  # b"" at EOF, queued like data so it is delayed too
            hold = self.delay_s + self.rng.uniform(-self.jitter_s, self.jitter_s)
            last = max(loop.time() + hold, last)
            self.queue.put_nowait((last, data))
            if not data:
                return
            self.held += len(data)
            if self.held > self.max_buffer:
                self.room.clear()
                await self.room.wait()

    async def _give(self, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        while True:
            release, data = await self.queue.get()
            await asyncio.sleep(max(0.0, release - loop.time()))
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()  # half-close: the other direction may still carry bytes
                return
            writer.write(data)
            await writer.drain()
            self.held -= len(data)
            if self.held <= self.max_buffer:
                self.room.set()


def _check_address(address: Address, field: str, allow_port_0: bool) -> Address:
    host, port = address
    low = 0 if allow_port_0 else 1
    if not isinstance(host, str) or not host:
        raise ValueError(f"{field} host={host!r} must be a non-empty string")
    if not isinstance(port, int) or not low <= port <= 65535:
        raise ValueError(f"{field} port={port!r} must be an integer in [{low}, 65535]")
    return (host, port)


def parse_address(text: str) -> Address:
    """``HOST:PORT`` or ``[V6HOST]:PORT`` → ``(host, port)``; ValueError names the bad text."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"address {text!r} must be HOST:PORT with PORT in [0, 65535]")
    return (host, int(port))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fedring.lab.delay",
        description="Forward TCP from --listen to --target, adding --delay-ms each way.",
    )
    parser.add_argument("--listen", type=_address_arg, required=True, help="HOST:PORT (0: any)")
    parser.add_argument("--target", type=_address_arg, required=True, help="HOST:PORT")
    parser.add_argument("--delay-ms", type=float, required=True, help="one-way delay, each way")
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="uniform ± spread")
    parser.add_argument("--seed", type=int, default=0, help="seed of the jitter")
    args = parser.parse_args(argv)
    try:
        proxy = DelayProxy(args.listen, args.target, args.delay_ms, args.jitter_ms, args.seed)
    except ValueError as exc:
        parser.error(str(exc))
    proxy.run()
    return 0


def _address_arg(text: str) -> Address:
    try:
        return parse_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


if __name__ == "__main__":
    sys.exit(main())
