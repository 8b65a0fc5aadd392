"""A shaped network link in front of a local server, in its own process: what object storage
is like from a training host, on a machine where the server is on 127.0.0.1.

    python benchmarks/shaped_link.py UPSTREAM_PORT[,PORT...] [--ttfb-ms 30] [--mbps 10]

Listens on a free port of 127.0.0.1 (printed on the first line of stdout) and forwards every
TCP connection to UPSTREAM_PORT (given several, each connection to the next in turn: servers
holding the same objects, `servers.py`). Each response waits until `ttfb_ms` after the request that
asked for it before its first byte (a request arriving while the previous answer still flows
waits its own `ttfb_ms` too), and each connection is paced to `mbps` megabytes per second
(a token bucket of 64 KiB): real object storage is bound by the time to the first byte and by
what one connection carries, so a reader fills the link only with enough requests in flight.
It is a TCP proxy (it does not parse HTTP): an answer's first bytes are those the server sends
after a request's bytes arrived.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import time
from report import parser

CHUNK = 1 << 16


@contextlib.contextmanager
def closing_on_end(writer):
    """The far side's writer closed when this direction ends (a connection reset included)."""
    try:
        yield
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def pipe_requests(reader, writer, asked: list) -> None:
    """Client to server, unshaped; each burst of request bytes records when it was asked."""
    with closing_on_end(writer):
        while data := await reader.read(CHUNK):
            asked.append(time.monotonic())
            writer.write(data)
            await writer.drain()


async def pipe_answers(reader, writer, asked: list, ttfb: float, rate: float) -> None:
    """Server to client: an answer's first byte no sooner than `ttfb` after its request, and
    the bytes paced to `rate` bytes/s."""
    sent_at, credit = time.monotonic(), 0.0
    with closing_on_end(writer):
        while data := await reader.read(CHUNK):
            if asked:  # the first bytes of an answer: the server's time counts toward the wait
                wait = asked[-1] + ttfb - time.monotonic()
                asked.clear()
                if wait > 0:
                    await asyncio.sleep(wait)
                sent_at, credit = time.monotonic(), 0.0
            now = time.monotonic()
            credit = min(credit + (now - sent_at) * rate, CHUNK)
            sent_at = now
            credit -= len(data)
            if credit < 0:
                await asyncio.sleep(-credit / rate)
            writer.write(data)
            await writer.drain()


async def serve(upstream: list[int], ttfb: float, rate: float) -> None:
    turn = itertools.count()

    async def connection(client_reader, client_writer):
        port = upstream[next(turn) % len(upstream)]  # (several servers holding the same objects: in turn)
        try:
            server_reader, server_writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            client_writer.close()
            return
        for w in (client_writer, server_writer):
            w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        asked: list = []
        await asyncio.gather(pipe_requests(client_reader, server_writer, asked),
                             pipe_answers(server_reader, client_writer, asked, ttfb, rate))

    server = await asyncio.start_server(connection, "127.0.0.1", 0, backlog=1024)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("upstream", help="the server's port, or several, comma-separated (servers holding the same "
                                     "objects: each connection goes to the next)")
    ap.add_argument("--ttfb-ms", type=float, default=30.0, help="milliseconds from a request to its answer's first byte")
    ap.add_argument("--mbps", type=float, default=10.0, help="megabytes per second one connection carries")
    args = ap.parse_args()
    asyncio.run(serve([int(p) for p in args.upstream.split(",")], args.ttfb_ms / 1e3, args.mbps * 1e6))


if __name__ == "__main__":
    main()
