"""Locks held while a stage runs: one per stage folder (two processes never write the same stage), and one
per GPU on the host (two runs never load a model onto the same GPUs).

A lock is an advisory `flock` on a file that also records its holder (pid, host, run, stage, start time,
command). The kernel releases the flock when the holder dies however it dies, so a lock left by a dead
process is taken over at once; its record is then reported as a note. A refusal names the live holder.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle_pipeline.errors import BadInput
from eagle_pipeline.gpus import visible_gpus

# Where the GPU locks live: shared by every user and run of the host, like the GPUs.
GPU_LOCK_DIR_VARIABLE = "EAGLE_GPU_LOCK_DIR"
DEFAULT_GPU_LOCK_DIR = "/tmp/eagle-pipeline-gpu-locks"


@dataclass
class HeldLocks:
    """Open lock files of this process; `release` (or the process's exit) releases the locks."""

    files: list[Any] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def release(self) -> None:
        """Empty each record, then unlock: the next holder finds a clean release, not a takeover."""
        for f in self.files:
            try:
                f.seek(0)
                f.truncate()
            except (OSError, ValueError):
                pass
            f.close()
        self.files.clear()

    def __enter__(self) -> "HeldLocks":
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()


def holder_record(**what: Any) -> dict[str, Any]:
    import datetime as dt

    return {"pid": os.getpid(), "host": socket.gethostname(),
            "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv), **what}


def describe(record: dict[str, Any]) -> str:
    parts = [f"pid {record.get('pid')} on {record.get('host')}", f"started {record.get('started')}"]
    if record.get("run"):
        parts.insert(0, f"run {record['run']!r} stage {record.get('stage')}")
    return ", ".join(parts)


def _read_record(f) -> dict[str, Any] | None:
    f.seek(0)
    try:
        record = json.loads(f.read() or "null")
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def take(path: Path, record: dict[str, Any], held: HeldLocks, busy: str, shared_by_users: bool = False) -> None:
    """Take the lock at `path` for this process, recording `record`; BadInput naming the holder when another
    live process has it (`busy` says what that means and what to do). A lock `shared_by_users` is left
    writable by every user of the host."""
    f = open(_open_lock_file(path), "r+")
    if shared_by_users and path.stat().st_uid == os.getuid():
        os.fchmod(f.fileno(), 0o666)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_record(f)
        f.close()
        raise BadInput(f"{path}: held by {describe(holder) if holder else 'another process'}; {busy}") from None
    previous = _read_record(f)
    if previous and previous.get("pid") != os.getpid():
        held.notes.append(f"{path}: taken over from a process that ended without releasing it ({describe(previous)})")
    f.seek(0)
    f.truncate()
    f.write(json.dumps(record))
    f.flush()
    held.files.append(f)


def _open_lock_file(path: Path) -> int:
    """The lock file's descriptor, created if need be; BadInput naming the path when the file system refuses."""
    blocker = path.parent
    while not blocker.exists() and blocker != blocker.parent:
        blocker = blocker.parent
    if not blocker.is_dir():
        raise BadInput(f"{blocker}: is a file where the folder of the lock {path.name} belongs; move the file away "
                       f"and rerun")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except IsADirectoryError:
        raise BadInput(f"{path}: is a folder where the lock file belongs; remove it (a lock holds no data) and "
                       f"rerun") from None
    except PermissionError as e:
        where = path if path.exists() else path.parent
        raise BadInput(f"{path}: cannot open the lock file ({e.strerror}; {where} belongs to {_owner(where)}): another "
                       f"user's run, or a folder you may not write; use a data_root (or run_name) of your own, or have "
                       f"it made writable for you") from None
    except OSError as e:
        raise BadInput(f"{path}: cannot open the lock file ({e.strerror}); fix the folder and rerun") from None


def _owner(path: Path) -> str:
    try:
        import pwd

        uid = path.stat().st_uid
        return "you" if uid == os.getuid() else f"user {pwd.getpwuid(uid).pw_name}"
    except (OSError, KeyError, ImportError):
        return "another user"


def take_gpu_locks(record: dict[str, Any], held: HeldLocks, lock_dir: Path | None = None) -> list[str]:
    """Lock every GPU this process may use (`visible_gpus`); the GPUs locked. Runs given disjoint
    CUDA_VISIBLE_DEVICES (the run config's `env`) take disjoint locks and run side by side."""
    gpus = visible_gpus() or []
    folder = Path(lock_dir or os.environ.get(GPU_LOCK_DIR_VARIABLE, DEFAULT_GPU_LOCK_DIR))
    if gpus and not folder.exists():
        folder.mkdir(parents=True, exist_ok=True)
        try:  # every user of the host locks its GPUs here: world-writable, like /tmp itself
            folder.chmod(0o1777)
        except OSError:
            pass
    for gpu in gpus:
        name = "".join(c if c.isalnum() or c in "-_" else "_" for c in gpu)
        take(folder / f"gpu-{name}.lock", record, held,
             busy=f"GPU {gpu} is in use by another pipeline job; wait for it, stop it (scripts/remote.sh stop), or give "
                  f"this run other GPUs with env: {{CUDA_VISIBLE_DEVICES: ...}} in its config", shared_by_users=True)
    return gpus
