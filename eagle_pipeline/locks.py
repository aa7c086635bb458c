"""Locks held while a stage runs: one per stage folder (two processes never write the same stage), and one
per GPU on the host (two runs never load a model onto the same GPUs).

A lock is an advisory `flock` on a file that also records its holder (pid, host, run, stage, start time,
command): docs/contracts.md, "Locks".

The run lock of a detached job (scripts/launch.sh, scripts/jobs.sh: one job per run) is the same kind of lock,
taken and read through this module's command line:

    python -m eagle_pipeline.locks hold LOCK [--link PATH] [KEY=VALUE ...] -- COMMAND ...
    python -m eagle_pipeline.locks state|describe|clear LOCK
    python -m eagle_pipeline.locks get LOCK KEY

`hold` is `hold()` (exit 2 with one `error:` line naming a live holder; SIGTERM, SIGINT and SIGHUP are left to
COMMAND, whose whole process group a stop signals, so the lock is held until COMMAND has ended); `state` prints
live, stale or free (`probe`); `get` one field of the record, `describe` the record in one line; `clear` is
`clear()` (exit 1 while a live process holds the lock).
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle_pipeline.atomic import nearest_existing
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
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv), **what}


def describe(record: dict[str, Any]) -> str:
    if "stages" in record:  # a detached job's run lock
        return (f"stages {record['stages']} of {record.get('config')} (pid {record.get('pid')} on "
                f"{record.get('host')}, started {record.get('started')})")
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
    blocker = nearest_existing(path.parent)
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
             busy=f"GPU {gpu} is in use by another pipeline job; wait for it, stop it (scripts/remote.sh stop), "
                  f"or give this run other GPUs with env: {{CUDA_VISIBLE_DEVICES: ...}} in its config",
             shared_by_users=True)
    return gpus


def probe(path: Path) -> tuple[str, dict[str, Any] | None]:
    """("live", the holder's record) while a process holds the lock at `path`; ("stale", its record) when a holder
    ended without releasing it; ("free", None) otherwise. The probe holds a shared lock for an instant."""
    try:
        f = open(path)
    except FileNotFoundError:
        return "free", None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return "live", _read_record(f)
        record = _read_record(f)
        return ("stale", record) if record else ("free", None)


def clear(path: Path) -> bool:
    """Empty the record a holder that ended left at `path`; False (and nothing changed) while one is live."""
    try:
        f = open(path, "r+")
    except FileNotFoundError:
        return True
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        f.truncate()
        return True


def hold(path: Path, fields: dict[str, str], command: list[str], link: Path | None = None) -> int:
    """Run `command` while holding the lock at `path` (recording this process, its process group and `fields`;
    `link`, where given, points at `path` meanwhile); its exit code, 128 + the signal that ended it. BadInput naming
    the holder when a live process has the lock."""
    with HeldLocks() as held:
        take(path, holder_record(pgid=os.getpgrp(), **fields), held,
             busy="wait for it to end, or stop it with scripts/jobs.sh stop")
        for note in held.notes:
            print(f"note: {note}", file=sys.stderr, flush=True)
        if link is not None:
            link.unlink(missing_ok=True)
            link.symlink_to(path)
        # A handler, not SIG_IGN: an ignored signal would stay ignored in `command`, a handler is reset by exec.
        for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(number, lambda *_: None)
        try:
            code = subprocess.call(command)
        finally:
            if link is not None:
                link.unlink(missing_ok=True)
        return code if code >= 0 else 128 - code


def main(argv: list[str]) -> int:
    usage = ("usage: python -m eagle_pipeline.locks hold LOCK [--link PATH] [KEY=VALUE ...] -- COMMAND ... | "
             "state|describe|clear LOCK | get LOCK KEY")
    action, args = (argv[0], argv[1:]) if argv else ("", [])
    if action == "hold" and "--" in args and args.index("--") >= 1 and args[-1] != "--":
        split = args.index("--")
        lock, options, command = Path(args[0]), args[1:split], args[split + 1:]
        link = None
        if options[:1] == ["--link"] and len(options) >= 2:
            link, options = Path(options[1]), options[2:]
        if all("=" in option for option in options):  # else the usage line below
            try:
                return hold(lock, dict(option.split("=", 1) for option in options), command, link)
            except BadInput as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
    if action in ("state", "describe", "clear") and len(args) == 1 or action == "get" and len(args) == 2:
        lock = Path(args[0])
        if action == "clear":
            return 0 if clear(lock) else 1
        state, record = probe(lock)
        if action == "state":
            print(state)
        elif action == "describe":
            print(describe(record or {}))
        else:
            print((record or {}).get(args[1], ""))
        return 0
    print(f"error: {usage}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
