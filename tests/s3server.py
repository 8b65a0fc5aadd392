"""A real S3-compatible server for the tests (moto in server mode on 127.0.0.1), and an HTTP
proxy between client and server that injects faults into object reads: dropped
connections, 500s, slow and truncated responses. It also counts the GETs of each object.
`Peak` polls a bounded object cache for the most bytes it held."""

from __future__ import annotations

import collections
import http.client
import logging
import os
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

KEYS = {"key": "testing", "secret": "testing"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """moto's S3 on a free port; `options(proxy=...)` are s3fs storage options reaching it.
    `S3Server("name")` makes that bucket (moto keeps one state per process: each test module
    uses a bucket of its own); `with S3Server(...) as server:` stops it at the end."""

    def __init__(self, bucket: str | None = None):
        from moto.server import ThreadedMotoServer

        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.port = free_port()
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()
        self.proxy = FaultProxy(self.port)
        if bucket is not None:
            self.fresh_bucket(bucket)

    def __enter__(self) -> "S3Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def options(self, via_proxy: bool = False) -> dict:
        port = self.proxy.port if via_proxy else self.port
        # the client retries nothing itself: what the tests see is forge-grain's own retrying
        return {**KEYS, "endpoint_url": f"http://127.0.0.1:{port}", "skip_instance_cache": True,
                "config_kwargs": {"retries": {"max_attempts": 1}, "read_timeout": 2, "connect_timeout": 2}}

    def fs(self):
        import s3fs

        return s3fs.S3FileSystem(**self.options())

    def fresh_bucket(self, name: str) -> None:
        """Bucket `name`, empty: moto keeps one state per process, and a module's fixtures set up
        again on the same xdist worker find the bucket of their first set-up there."""
        fs = self.fs()
        if fs.exists(name):
            fs.rm(name, recursive=True)
            fs.invalidate_cache()
        fs.mkdir(name)

    def stop(self) -> None:
        self.proxy.stop()
        self.server.stop()


class FaultProxy:
    """Forwards HTTP to the server; `fail(part, kind, times, method)` makes the next `times`
    requests (GETs by default) of objects whose path contains `part` fail with `kind`:
    "drop", "500", "delay", "truncate", "hang" (a minute without an answer). `gets` and `puts` count object reads and writes, `sent`
    the bytes of the reads served, `lists` the listing requests, `requests` all requests
    (HEADs included); `latency` (seconds) delays
    every object read before it is forwarded, and `peaks[prefix]` is the most reads in flight
    at once under /bucket/prefix/."""

    def __init__(self, upstream: int):
        self.upstream = upstream
        self.faults: list[list] = []
        self.gets: collections.Counter = collections.Counter()
        self.puts: collections.Counter = collections.Counter()
        self.sent: collections.Counter = collections.Counter()  # bytes of object reads served, by path
        self.lists = self.requests = 0
        self.seen: list[tuple[str, str]] = []  # (method, path) of every request, in order
        self.latency = 0.0
        self.regions: dict[str, str] = {}  # bucket -> its region: a request signed for another is S3's 301
        self.active: collections.Counter = collections.Counter()  # reads in flight, by prefix
        self.peaks: collections.Counter = collections.Counter()
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.server.handle_error = lambda *_: None  # a client gone while a fault held its answer
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def fail(self, part: str, kind: str, times: int = 1, method: str = "GET") -> None:
        with self.lock:
            self.faults.append([part, kind, times, method])

    def clear(self) -> None:
        with self.lock:
            self.faults.clear()
            self.gets.clear()
            self.puts.clear()
            self.sent.clear()
            self.lists = self.requests = 0
            self.seen.clear()
            self.latency = 0.0
            self.peaks.clear()

    def take(self, method: str, path: str) -> str | None:
        with self.lock:
            self.requests += 1
            self.seen.append((method, path))
            if method == "GET" and ("list-type=" in path or "prefix=" in path):
                self.lists += 1
            if method not in ("GET", "PUT") or "?" in path:  # object reads and writes, not listings
                return None
            (self.gets if method == "GET" else self.puts)[path] += 1
            for f in self.faults:
                if f[0] in path and f[2] > 0 and f[3] == method:
                    f[2] -= 1
                    return f[1]
        return None

    def stop(self) -> None:
        self.server.shutdown()


def _handler(proxy: FaultProxy):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _forward(self):
            read = self.command == "GET" and "?" not in self.path
            prefix = self.path.split("?")[0].split("/")[2] if self.path.count("/") > 2 else ""
            self._counted = prefix if read else None
            if read:
                with proxy.lock:
                    proxy.active[prefix] += 1
                    proxy.peaks[prefix] = max(proxy.peaks[prefix], proxy.active[prefix])
            try:
                self._answer(read)
            finally:
                self._answered()

        def _answered(self):
            """The read no longer counts as in flight: called before its answer is sent, since
            a client that has its answer may send its next read before this thread runs again
            (counted after the write, a pool of 6 reads showed 7 in flight on a loaded machine)."""
            if self._counted is not None:
                with proxy.lock:
                    proxy.active[self._counted] -= 1
                self._counted = None

        def _answer(self, read: bool):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self._elsewhere():
                return
            fault = proxy.take(self.command, self.path)
            if read and proxy.latency:
                time.sleep(proxy.latency)
            if fault == "drop":
                self.close_connection = True
                return
            if fault == "delay":
                time.sleep(3)  # past the client's read timeout
            if fault == "hang":
                time.sleep(60)  # a server that never answers, as far as a test can tell
            if fault != "500":  # a failing server does not store or serve anything
                conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream, timeout=30)
                conn.request(self.command, self.path, body=body, headers=dict(self.headers))
                resp = conn.getresponse()
                data = resp.read()
                conn.close()
            if fault == "500":
                resp_status, data = 500, b"<Error><Code>InternalError</Code><Message>injected</Message></Error>"
                headers = [("Content-Type", "application/xml")]
            else:
                resp_status = resp.status
                headers = [(k, v) for k, v in resp.getheaders()
                           if k.lower() not in ("content-length", "transfer-encoding", "connection")]
            self._answered()
            self.send_response(resp_status)
            for k, v in headers:
                self.send_header(k, v)
            length = resp.getheader("Content-Length", "0") if self.command == "HEAD" else str(len(data))
            self.send_header("Content-Length", length)
            self.end_headers()
            if fault == "truncate":
                self.wfile.write(data[: len(data) // 2])
                self.close_connection = True
                return
            if self.command != "HEAD":
                self._count_sent(resp_status, data)
                self.wfile.write(data)

        def _count_sent(self, status: int, data: bytes) -> None:
            """Counted before the write, as `_answered` is: a client that has its bytes may look
            at `sent` before this thread runs again (counted after the write, a test that read one
            block saw 0 bytes sent on a loaded machine)."""
            if self.command == "GET" and "?" not in self.path and status < 300:
                with proxy.lock:
                    proxy.sent[self.path] += len(data)

        def _elsewhere(self) -> bool:
            """A request for a bucket of `proxy.regions` signed for another region (or a HEAD of
            the bucket, signed or not) answered as S3 answers it: a 301 without a Location,
            the bucket's region in `x-amz-bucket-region` (and, but for a HEAD, PermanentRedirect)."""
            bucket = self.path.split("?")[0].split("/")[1]
            region = proxy.regions.get(bucket)
            signed = re.search(r"Credential=[^/]+/[^/]+/([^/]+)/", self.headers.get("Authorization", ""))
            bucket_head = self.command == "HEAD" and self.path.split("?")[0].strip("/") == bucket
            if region is None or not bucket_head and signed is not None and signed.group(1) == region:
                return False
            with proxy.lock:
                proxy.seen.append((self.command, self.path))
            body = b"" if self.command == "HEAD" else (
                b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>PermanentRedirect</Code><Message>The bucket you "
                b"are attempting to access must be addressed using the specified endpoint.</Message></Error>")
            self.send_response(200 if bucket_head and signed is not None and signed.group(1) == region else 301)
            self.send_header("x-amz-bucket-region", region)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return True

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

    return Handler


class Peak:
    """The most bytes a bounded object cache held (its directory, ledger included), polled
    under its lock while a run reads: `cache`, an `ObjectCache` of the directory (any
    process's runs may share it)."""

    def __init__(self, cache):
        self.cache, self.most, self._stop = cache, 0, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self):
        while not self._stop.is_set():
            self.most = max(self.most, self.cache.used())
            self._stop.wait(0.002)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.most
