"""Ends a local Ray pool's processes when the server that started them dies, however it dies.

    python -m cluster.reaper RECORD SERVER_PID

Ray makes the processes the server starts itself (its control service, the raylet) die with it, but
not the ones those start in turn (the agents, the actors' worker processes): after a SIGKILL of the
server they can outlive it, still listening. The reaper is a child of the server that asks the kernel
for a signal when its parent dies (a parent-death signal). Until then it keeps RECORD, a JSON list of
every process below the server (process id and start time), up to date; when the signal comes (or its
parent is already gone) it kills every recorded process still running. A server that starts again
reads the same RECORD first (`end_recorded`), so whatever escaped is ended then at the latest.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time
from pathlib import Path

import psutil

SCAN_INTERVAL_S = 1.0
_PR_SET_PDEATHSIG = 1  # from linux/prctl.h


def set_parent_death_signal(signum: int = signal.SIGTERM) -> None:
    """Ask Linux to send `signum` to this process when its parent dies (a no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0)


def descendants(pid: int, *, exclude: int | None = None) -> list[dict]:
    """(pid, start time) of every process below `pid`."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
    found = []
    for child in children:
        try:
            if child.pid != exclude:
                found.append({"pid": child.pid, "create_time": child.create_time()})
        except psutil.Error:
            continue
    return found


def write_record(record: Path, processes: list[dict]) -> None:
    """Replace RECORD atomically (a reader never sees half a list)."""
    temporary = record.with_name(record.name + ".tmp")
    temporary.write_text(json.dumps(processes))
    os.replace(temporary, record)


def end_recorded(record: Path) -> int:
    """Kill every process RECORD lists that is still the same process (same start time); returns how
    many were killed. The record is removed."""
    try:
        processes = json.loads(record.read_text())
    except (OSError, ValueError):
        return 0
    killed = 0
    for entry in processes if isinstance(processes, list) else ():
        try:
            process = psutil.Process(int(entry["pid"]))
            if abs(process.create_time() - float(entry["create_time"])) > 0.01:
                continue  # the id now belongs to another process
            process.kill()
            killed += 1
        except (psutil.Error, KeyError, TypeError, ValueError):
            continue
    record.unlink(missing_ok=True)
    return killed


def main(argv: list[str]) -> int:
    record, server_pid = Path(argv[0]), int(argv[1])
    known: dict[int, dict] = {}

    def end(*_: object) -> None:
        write_record(record, list(known.values()))
        end_recorded(record)
        os._exit(0)

    signal.signal(signal.SIGTERM, end)
    # Ctrl-C in the server's terminal reaches the whole process group; the server then shuts Ray down and
    # stops the reaper itself, which must keep its record up to date until then (and print nothing).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    set_parent_death_signal(signal.SIGTERM)
    while True:
        if os.getppid() != server_pid:  # the server died before the parent-death signal was set
            end()
        for entry in descendants(server_pid, exclude=os.getpid()):
            known[entry["pid"]] = entry
        write_record(record, list(known.values()))
        time.sleep(SCAN_INTERVAL_S)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
