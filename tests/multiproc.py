"""Helpers for tests that launch real multi-process runs."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_jax_processes(script, *args, n: int = 2, timeout: int = 300) -> None:
    """Run `script PORT PROCESS_ID *args` as n JAX CPU processes; fail with their output."""
    port = free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    procs = [
        subprocess.Popen([sys.executable, str(script), str(port), str(i), *map(str, args)],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(n)
    ]
    for proc in procs:
        out, _ = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, out


def wait_forked(pid: int, timeout: float = 60) -> int | None:
    """The exit code of forked child `pid`, or None (the child killed) when it has not ended
    within `timeout` seconds: a hung child fails a test instead of hanging it."""
    deadline = time.monotonic() + timeout
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        return None
    return os.waitstatus_to_exitcode(done[1])
