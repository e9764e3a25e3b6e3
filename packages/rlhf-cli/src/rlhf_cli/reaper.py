"""Ends what a driver leaves behind when it dies without cleaning up (SIGKILL, OOM kill).

A local Ray cluster's daemons outlive a killed driver: Ray's dashboard and runtime-env agents linger for
minutes, and so can actors. On a cluster the run joined (``--ray.address``, ``$RAY_ADDRESS``) Ray ends the
dead driver's actors, but not what they started (an agent program's children). ``python -m rlhf_cli.reaper
PID TOKEN`` runs in a session of its own and notes once a second, while process PID lives, every descendant
of it and every process whose environment holds ``RLHF_RUN_TOKEN=TOKEN`` (the run's Ray workers, which get
it through the run's runtime environment, and what they started) with their descendants; once PID is gone
it SIGKILLs the ones still running. Other jobs' workers on the cluster lack the token and are left alone.
Processes are named by (pid, start time), so a reused pid is never killed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

POLL_S = 1.0
TOKEN_ENV = "RLHF_RUN_TOKEN"
TOKEN = uuid.uuid4().hex  # this driver's: the environment of the workers it starts holds it
_reaper: subprocess.Popen | None = None


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a running process, from ``/proc/PID/stat``."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, ..., starttime is 20th
    return int(fields[1]), int(fields[19])


def descendants(*roots: int) -> set[tuple[int, int]]:
    """(pid, start time) of every process below ``roots``."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) is not None:
            children.setdefault(stat[0], []).append((int(entry), stat[1]))
    found, todo = set(), list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child[0])
    return found


def marked(token: str) -> set[tuple[int, int]]:
    """(pid, start time) of the processes whose environment holds ``RLHF_RUN_TOKEN=token`` (those of other
    users cannot be read, and are not this run's)."""
    mark = f"{TOKEN_ENV}={token}".encode()
    found = set()
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError):
            if entry.isdigit() and mark in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                if (stat := _stat(int(entry))) is not None:
                    found.add((int(entry), stat[1]))
    return found


def start() -> None:
    """Start this process's reaper, once (a process that starts several clusters needs one); nothing where
    there is no ``/proc``."""
    global _reaper
    if _reaper is None and Path("/proc/self/stat").exists():
        _reaper = subprocess.Popen(
            [sys.executable, "-m", "rlhf_cli.reaper", str(os.getpid()), TOKEN],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )


def main(driver_pid: int, token: str) -> None:
    driver = _stat(driver_pid)
    seen = set()
    # the start time, not the parent: a driver whose shell exits is re-parented and still alive
    while driver is not None and (now := _stat(driver_pid)) is not None and now[1] == driver[1]:
        workers = marked(token)
        seen |= workers | descendants(driver_pid, *(pid for pid, _ in workers))
        time.sleep(POLL_S)
    for pid, started in seen:
        if pid != os.getpid() and (stat := _stat(pid)) is not None and stat[1] == started:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
