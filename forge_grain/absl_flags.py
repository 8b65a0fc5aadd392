"""Grain's worker processes read absl flags; outside `absl.app.run` nobody parses them."""

from __future__ import annotations


def ensure_absl_flags_parsed() -> None:
    """Mark absl flags parsed (with their defaults) unless the program already parsed them.

    Without this, Grain's multiprocessing (`mp_prefetch`, `DataLoader(worker_count>0)`)
    raises `UnparsedFlagAccessError` in programs that do not use `absl.app`.
    """
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
