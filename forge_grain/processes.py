"""What each process must own itself: objects that hold a thread, a lock, a native handle or
a network client.

`fork` (how a DataLoader starts its workers by default) copies a process's memory but only
the thread that called it. A forked child inherits objects whose threads do not exist
there, locks that a vanished thread held, and clients whose connections and event loops
belong to the parent. Used in the child they hang (work queued for threads that never run,
a lock never released) or crash (a native lock waking a thread that is gone). So each such
object is made per process, by one of three means:

- `per_process(make)`: an attribute made on first use in each process (a network client, a
  thread pool); a forked child makes its own instead of using the parent's.
- `at_fork(fn)`: `fn()` runs in every forked child before any of its own code (module-level
  locks, semaphores and request queues start afresh).
- `exit_with_parent()`: a worker process whose parent is gone ends within a second, also when
  it is blocked in a download or a lock, or in its own exit (an orphaned worker otherwise
  lives on).

At interpreter exit, `stop_at_exit(thread)` threads are told to stop (`EXITING`) and joined
before the interpreter tears down: a daemon thread still inside native code then (an
ArrayRecord read) would be unwound by the interpreter's exit and abort the process
(`terminate called without an active exception`). docs/architecture.md lists which objects
use which means.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread
import os
import threading
import time
import weakref

_LOCK = threading.RLock()  # guards the making of per-process values (reset in a child: see below)
_PID = os.getpid()  # this process's (`os.getpid` is a system call, 0.14 us: a step asks for several values)
EXITING = threading.Event()  # set when the interpreter begins to exit: background threads stop
_STOPPED_AT_EXIT: weakref.WeakSet = weakref.WeakSet()
_JOIN_AT_EXIT_S = 5.0  # how long exit waits for a background thread to finish what it is doing


class per_process:
    """A descriptor: `obj.<name>` is `make(obj)`, made on first use in each process.

    The value is kept in the instance's `__dict__` with the pid that made it; a forked child
    sees another pid and makes its own (the parent's is left alone: closing it there could
    close what the parent still uses, such as a shared socket)."""

    def __init__(self, make):
        self.make = make
        self.__doc__ = make.__doc__

    def __set_name__(self, owner, name):
        self.slot = f"_{name}_per_process"

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        held, pid = obj.__dict__.get(self.slot), _PID
        if held is not None and held[0] == pid:  # the common case: one lookup
            return held[1]
        with _LOCK:
            held = obj.__dict__.get(self.slot)
            if held is None or held[0] != pid:
                held = (pid, self.make(obj))
                obj.__dict__[self.slot] = held
        return held[1]

    def keep(self, obj, value) -> None:
        """Take `value` as this process's (made along with something else)."""
        obj.__dict__[self.slot] = (_PID, value)

    def made(self, obj):
        """The value if this process made it already, else None (nothing is made)."""
        held = obj.__dict__.get(self.slot)
        return held[1] if held is not None and held[0] == _PID else None

    def forget(self, obj) -> None:
        """Drop the value (closed by its owner): the next use makes another."""
        obj.__dict__.pop(self.slot, None)


def without_per_process(state: dict) -> dict:
    """An instance's `__dict__` for pickling: values made per process stay in their process."""
    return {k: v for k, v in state.items() if not k.endswith("_per_process")}


def at_fork(fn) -> None:
    """Run `fn()` in every forked child, before the child's own code."""
    os.register_at_fork(after_in_child=fn)


def _in_child() -> None:
    """A forked child's own lock for per-process values (the parent's may be held) and its pid."""
    global _LOCK, _PID
    _LOCK = threading.RLock()
    _PID = os.getpid()


at_fork(_in_child)  # (at this module's import: before any other module's hook, which may use values)


def stop_at_exit(thread: threading.Thread) -> None:
    """Join `thread` when the interpreter exits (it must return soon after `EXITING` is set)."""
    _STOPPED_AT_EXIT.add(thread)


def _exiting() -> None:
    EXITING.set()


# Set when the main thread ends, before the interpreter joins the worker threads of every
# ThreadPoolExecutor (`concurrent.futures.thread`'s hook, registered on its import; these hooks
# run newest first) and long before `atexit`'s hooks: a download waiting there for room in a
# bounded cache, in an executor, hung the exit of a script that did not close its pipeline.
assert concurrent.futures.thread  # (imported above, so that its hook is registered before this one)
threading._register_atexit(_exiting)


@atexit.register
def _stop_threads() -> None:
    EXITING.set()
    for thread in list(_STOPPED_AT_EXIT):
        if thread.is_alive() and thread is not threading.current_thread():
            thread.join(_JOIN_AT_EXIT_S)


_FORKED_BY: list[str] = []  # in a forked child: the name of the parent's thread that forked it


def _clear_exiting() -> None:
    EXITING.clear()  # a child forked during exit handlers is a new process, not exiting
    _FORKED_BY[:] = [threading.current_thread().name]  # (the forking thread is the child's only one)


at_fork(_clear_exiting)

_WATCHED: set[int] = set()  # pids of processes that already watch their parent


def exit_with_parent(poll_s: float = 0.5) -> None:
    """End this process when its parent ends: a DataLoader worker whose training process was
    killed must not live on (holding memory, /dev/shm and the cache's locks).

    A daemon thread polls the parent pid, and goes on polling while this process exits: a
    worker that noticed first (torch's own check) and began to exit waits there for its
    threads, and one of them may wait on a download that never comes (the watch used to stop
    when exit began, and such a worker lived on). Where the parent's main thread forked this
    process (a DataLoader's default), Linux's PR_SET_PDEATHSIG has the kernel kill it as
    well, with no thread of its own needing to run (one stuck holding the GIL would stop the
    watch). It is not used otherwise: it fires when the *thread* that forked ends, which need
    not be the end of the process."""
    pid = os.getpid()
    if pid in _WATCHED:
        return
    _WATCHED.add(pid)
    parent = os.getppid()
    if parent == 1:  # already orphaned
        os._exit(1)
    if _FORKED_BY == ["MainThread"]:
        die_with_parent(parent)

    def watch():
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                os._exit(1)  # no clean-up: the process it served is gone

    threading.Thread(target=watch, name="forge-grain-parent-watch", daemon=True).start()


def die_with_parent(parent: int) -> None:
    """Linux: the kernel sends this process SIGKILL when the thread that started it ends
    (`parent`: its pid then; one gone already ends this process now). Elsewhere: nothing."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the call
            os._exit(1)
    except (OSError, AttributeError):
        pass


def usable_cores() -> int:
    """The cores this process may run on: its affinity (a job's share of a node, as schedulers
    and `taskset` set it), not the node's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)

