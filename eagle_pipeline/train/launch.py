"""Multi-GPU training: the torch.distributed.run command for a prepared run, and the entry point
(`python -m eagle_pipeline.train.launch <out_dir>/launch.json`) that it starts on every rank.

The same command also runs on the CPU with an explicit number of processes (gloo instead of nccl, see
patches/speculators_cpu.py), which is how the launcher is tested on hosts without GPUs.

launch.json carries the run's settings and paths to the ranks; it is rewritten at every launch and
never compared (the stage manifest decides whether a run may resume). Run the command with the
repository root as the working directory (config.REPO_ROOT), then call runner.finalize_training.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from eagle_pipeline import atomic
from eagle_pipeline.config import TrainConfig
from eagle_pipeline.errors import BadInput
from eagle_pipeline.train.runner import prepare, run_speculators
from eagle_pipeline.train.settings import TrainRun

LAUNCH_FILE = "launch.json"


def torchrun_command(train: TrainConfig, run: TrainRun, num_processes: int | None = None) -> list[str]:
    """Prepare a run and return the command that trains it: one process per GPU (train.num_gpus) on
    'cuda'; on 'cpu' only with an explicit num_processes, since a CPU run otherwise trains in-process."""
    if run.device == "cuda":
        if num_processes is not None:
            raise ValueError("num_processes is for CPU runs; a GPU run starts one process per GPU (train.num_gpus)")
        processes = int(train.num_gpus)
    elif num_processes is None:
        raise BadInput("train.num_gpus: multi-GPU runs train on 'cuda'; set num_gpus to 0 to train on the CPU")
    elif num_processes < 1:
        raise ValueError(f"num_processes must be at least 1, got {num_processes}")
    else:
        processes = num_processes
    prepare(train, run)
    launch_file = run.out_dir / LAUNCH_FILE
    atomic.write_json(launch_file, {"train": train.model_dump(mode="json"), "run": run.to_json()})
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={processes}",
        "-m",
        "eagle_pipeline.train.launch",
        str(launch_file),
    ]


def read_launch_file(path: Path) -> tuple[TrainConfig, TrainRun]:
    values = json.loads(Path(path).read_text())
    return TrainConfig.model_validate(values["train"]), TrainRun(**values["run"])


def main(argv: list[str]) -> int:
    """One rank of a run that torchrun_command prepared."""
    import argparse

    parser = argparse.ArgumentParser(description="Run one training rank (started by torch.distributed.run).")
    parser.add_argument("launch_file", help=f"{LAUNCH_FILE} written by torchrun_command()")
    args = parser.parse_args(argv)
    run_speculators(*read_launch_file(Path(args.launch_file)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
