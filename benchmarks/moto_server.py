"""moto's S3 server as the benchmarks run it: `python benchmarks/moto_server.py -H HOST -p PORT`.

moto (5.2) answers a ranged GET by copying the whole object, under a lock of the object's
own (`FakeKey.value`), and then cutting the range out: reading one object in parts costs
its size once per part, and its parts are served one at a time. A real object store serves
a range at the cost of the range, and the parts of one object in parallel; a reader that
reads one object at a time (a bounded cache) would be measured against moto's cost, not
its own. Here each object's bytes are kept once (dropped when it is rewritten) and a GET
slices them without the lock; everything else is moto's. Every reader in a benchmark reads
the same server, forge-grain and the peers alike. The tests use moto as it is.
"""

from __future__ import annotations

import sys

from moto.s3 import models
from moto.server import main

_value = models.FakeKey.value


def _kept(key) -> bytes:
    held = key.__dict__.get("_bench_bytes")
    if held is None:
        held = key.__dict__["_bench_bytes"] = _value.fget(key)
    return held


def _set(key, new_value) -> None:
    key.__dict__.pop("_bench_bytes", None)
    _value.fset(key, new_value)


models.FakeKey.value = property(_kept, _set)

if __name__ == "__main__":
    sys.exit(main())
