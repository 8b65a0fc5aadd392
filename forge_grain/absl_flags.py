"""What Grain needs from absl outside `absl.app.run`: flags marked parsed, and one warning
that means nothing to a user without jax silenced."""

from __future__ import annotations

import importlib.util
import logging
import sys

_PROFILER_WARNING = "Failed to load jax profiler"


def ensure_absl_flags_parsed() -> None:
    """Mark absl flags parsed (with their defaults) unless the program already parsed them.

    Without this, Grain's multiprocessing (`mp_prefetch`, `DataLoader(worker_count>0)`)
    raises `UnparsedFlagAccessError` in programs that do not use `absl.app`.
    """
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def _not_the_profiler_warning(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(_PROFILER_WARNING)


def quiet_grain_without_jax() -> None:
    """Grain logs `WARNING:absl:Failed to load jax profiler` when it is imported where jax
    is not installed: forge-grain needs no jax, and a user reads the line as a failure.
    Only that message is dropped, and only where jax is absent (a broken jax still warns)."""
    if "grain" in sys.modules or importlib.util.find_spec("jax") is not None:
        return
    from absl import logging as absl_logging  # creates absl's own logger, which the filter joins

    absl_logging.get_absl_logger().addFilter(_not_the_profiler_warning)
