"""moto's S3 server as the benchmarks run it: `python benchmarks/moto_server.py -H HOST -p PORT`.

moto (5.2) answers a ranged GET by copying the whole object, under a lock of the object's
own (`FakeKey.value`), and then cutting the range out: reading one object in parts costs
its size once per part, and its parts are served one at a time. A real object store serves
a range at the cost of the range, and the parts of one object in parallel; a reader that
reads one object at a time (a bounded cache) would be measured against moto's cost, not
its own. Here each object's bytes are kept as they are written (dropped when it is
rewritten) and a GET slices them without the lock. (Kept at each object's first GET instead,
the 16 GETs arriving together at a 400 MB object each read it whole, in turn under its lock:
0.4 s each, the last answered after 6 s.)

Two more costs of moto's on every request are taken out, both a server's own work that a
real bucket does not do on the reader's host: its dispatcher, under one lock for all
requests, lists moto's package directory (`list_of_moto_modules`: a `listdir` and ~150
`isdir` calls) to find the service a request is for, so every request passed through that
one section in turn; the list is read once here. And werkzeug logs a line for every request
to stderr (a file here); warnings only here. On a two-core machine, 16 threads asking for
ranged GETs of 512 KiB, moto answered 176 a second with both, at 5.6 ms of its CPU each, and
270-284 a second without, at 3.1-3.4 ms (`docs/benchmarks.md`).
Everything else is moto's. Every reader in a benchmark reads the same server, forge-grain and
the peers alike. The tests use moto as it is.
"""

from __future__ import annotations

import logging
import sys
import threading

from moto import backends
from moto.s3 import models
from moto.server import main

_value = models.FakeKey.value
_FILLING = threading.Lock()


def _kept(key) -> bytes:
    held = key.__dict__.get("_bench_bytes")
    if held is None:  # (not set since the server started: read once, not by each request arriving meanwhile)
        with _FILLING:
            held = key.__dict__.get("_bench_bytes")
            if held is None:
                held = key.__dict__["_bench_bytes"] = _value.fget(key)
    return held


def _set(key, new_value) -> None:
    key.__dict__.pop("_bench_bytes", None)
    _value.fset(key, new_value)
    if isinstance(new_value, bytes):  # (kept as written: the first GETs do not read it back)
        key.__dict__["_bench_bytes"] = new_value


models.FakeKey.value = property(_kept, _set)
_MODULES = tuple(backends.list_of_moto_modules())  # (the installed package's directories: fixed)
backends.list_of_moto_modules = lambda: _MODULES

if __name__ == "__main__":
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    sys.exit(main())
