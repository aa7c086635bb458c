"""Killing a process together with every process below it (Linux, read from /proc): vLLM's engine core and workers
outlive the process that started them (docs/engines.md, "Engine processes")."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path


def kill_pid_tree(pid: int, reap: Callable[[], object] | None = None) -> None:
    """SIGKILL a process and all its descendants. Each is stopped first, until no new one appears, so none
    can start another or be orphaned (and so lost from the tree) while the others are killed. `reap` waits
    for the process itself where this one is its parent."""
    stopped: list[int] = []
    while True:
        found = [p for p in [pid, *descendants(pid)] if p not in stopped]
        if not found:
            break
        for p in found:
            _signal(p, signal.SIGSTOP)
        stopped += found
    for p in stopped:
        _signal(p, signal.SIGKILL)
    if reap is not None:
        reap()
    # The others are reaped by whoever inherits them, not by us: wait until each is dead (gone or a zombie).
    deadline = time.monotonic() + 10
    while any(process_state(p) not in ("Z", "X", None) for p in stopped) and time.monotonic() < deadline:
        time.sleep(0.05)


def _stats() -> Iterator[tuple[int, list[str]]]:
    """(pid, the fields of /proc/<pid>/stat after the command's name: state, parent, group, ...) of every process."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                yield int(entry.name), (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # gone meanwhile
                continue


def descendants(pid: int) -> list[int]:
    """The live processes below `pid`."""
    children: dict[int, list[int]] = {}
    for child, fields in _stats():
        children.setdefault(int(fields[1]), []).append(child)
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(), []):
            found.append(child)
            queue.append(child)
    return found


def live_group_members(group: int) -> list[int]:
    """The processes of process group `group` that have not exited. A zombie (exited, its parent has not reaped
    it yet, or never will where that parent is a container's init that does not reap) still answers
    `killpg(group, 0)`, but holds nothing: it counts as gone."""
    return [pid for pid, fields in _stats() if int(fields[2]) == group and fields[0] not in ("Z", "X")]


def process_state(pid: int) -> str | None:
    """The process's state letter (R, S, Z, ...), None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
