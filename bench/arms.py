"""What the benchmark commands share: their common options, how they end, their work folders, and arms made by
running the pipeline's stages for real on copies of a finished run's conversations (as bench.run's storage arms)."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eagle_pipeline import atomic, outputs
from eagle_pipeline.config import RunConfig
from eagle_pipeline.errors import BadInput
from eagle_pipeline.samples import SAMPLES_DIR, sample_path
from eagle_pipeline.stage import read_manifest

REPO = Path(__file__).resolve().parent.parent
WORK_MARKER = ".benchmark-work-dir"
ARMS = {"bf16": "bfloat16", "fp8": "fp8"}  # arm name -> hidden_states.storage_dtype


def parser(prog: str, description: str, work: str) -> argparse.ArgumentParser:
    """A command's parser with the options every command on a pipeline config takes: --config, --set, --work-dir
    (default `<data_root>/<run_name>-<work>`)."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the pipeline run's config (e.g. configs/tiny.yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override, as for the stage scripts (applies to the run read and every run made)")
    parser.add_argument("--work-dir", help=f"folder for its own runs (default: <data_root>/<run_name>-{work})")
    return parser


class IncompleteFigures(Exception):
    """The command ran to its end, but a figure it exists to measure is missing; the message names each."""


def run_command(run: Callable[[argparse.Namespace], Any], args: argparse.Namespace, *, interrupted: str,
                logs: str) -> int:
    """`run(args)` with docs/contracts.md's exit codes: 2 with one `error:` line for bad input, 130 when
    interrupted, 1 with one `failed:` line naming what is missing when a run finished without every figure, 1 with
    the traceback and where to look for anything else."""
    try:
        run(args)
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except IncompleteFigures as e:
        print(f"failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"interrupted: {interrupted}", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - any other failure: exit 1 with where to look
        traceback.print_exc()
        print(f"failed: {type(e).__name__}: {e}; {logs}", file=sys.stderr)
        return 1
    return 0


def work_dir(args: argparse.Namespace, cfg: RunConfig, work: str) -> Path:
    return Path(args.work_dir).resolve() if args.work_dir else cfg.run_dir.with_name(f"{cfg.run_name}-{work}")


def prepare_work_dir(path: Path, marker: str = WORK_MARKER, made_by: str = "bench.run",
                     kind: str = "benchmark work folder") -> None:
    """Empty the work folder of an earlier run of `made_by`; refuse a folder that is not one (no `marker`)."""
    if path.exists():
        if any(path.iterdir()) and not (path / marker).exists():
            raise BadInput(f"--work-dir: {path} exists and is not a {kind}; choose an empty or new folder")
        shutil.rmtree(path)
    (path / "logs").mkdir(parents=True)
    (path / marker).write_text(f"made by `python -m {made_by}`; emptied by every run\n")


def copy_conversations(source_stage: Path, target_stage: Path, num_samples: int) -> int:
    """Start an arm from the pipeline's finished stage 01: its first `num_samples` conversations."""
    from datasets import load_from_disk

    conversations = load_from_disk(str(source_stage / "conversations"))
    if num_samples < len(conversations):
        conversations = conversations.select(range(num_samples))
    target_stage.mkdir(parents=True)
    conversations.save_to_disk(str(target_stage / "conversations"))
    manifest = read_manifest(source_stage)
    manifest["counts"] = {**manifest["counts"], "samples": len(conversations), "copied_from": str(source_stage)}
    # The copy holds other files than the source: its record is of its own files, or stage 02 refuses them.
    manifest["outputs"] = outputs.record_outputs(target_stage)
    atomic.write_json(target_stage / "manifest.json", manifest)
    return len(conversations)


def copy_captured_states(source_stage: Path, target_stage: Path, num_samples: int) -> None:
    """Give an arm the pipeline run's captured states of its conversations, so that its stage 02 resumes
    with nothing left to capture (no vLLM engine). Only for an arm that stores them as the pipeline run
    did: stage 02 keeps a file whose token ids and shape match, whatever its storage dtype."""
    source, target = source_stage / "data" / SAMPLES_DIR, target_stage / "data" / SAMPLES_DIR
    target.mkdir(parents=True)
    for row in range(num_samples):
        if sample_path(source, row).is_file():
            shutil.copyfile(sample_path(source, row), sample_path(target, row))


def run_stage(script: str, config: str, overrides: list[str], log_path: Path, log: Callable[[str], None]) -> None:
    """One stage script as its own process (as the pipeline runs it); its output goes to log_path."""
    command = [sys.executable, str(REPO / f"{script}.py"), "--config", config]
    for assignment in overrides:
        command += ["--set", assignment]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    with open(log_path, "w") as out:
        out.write("$ " + " ".join(command) + "\n")
        out.flush()
        result = subprocess.run(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
        log(tail)
        raise RuntimeError(f"{script} exited with {result.returncode}; its output: {log_path}")


def convert_drafter(run_dir: Path, out_dir: Path, vocab_size: int) -> None:
    """The arm's drafter in vLLM's format, from the checkpoint stage 05 would pick (best, else last)."""
    from eagle_pipeline.convert import convert_for_vllm

    trained = read_manifest(run_dir / "04_train")
    best = trained["counts"].get("best") or {}
    checkpoint = run_dir / "04_train" / (best.get("checkpoint") or trained["counts"]["last_checkpoint"])
    convert_for_vllm(checkpoint, out_dir, target_vocab_size=vocab_size, layer_ids=trained["inputs"]["layer_ids"])
