"""Multi-GPU training: the torch.distributed.run command for a prepared run, and the entry point
(`python -m eagle_pipeline.train.launch <out_dir>/launch.json`) that it starts on every rank.

The same command also runs on the CPU with an explicit number of processes (gloo instead of nccl, see
patches/speculators_cpu.py), which is how the launcher is tested on hosts without GPUs.

launch.json carries the run's settings and paths to the ranks; it is rewritten at every launch and
never compared (the stage manifest decides whether a run may resume). Run the command with the
repository root as the working directory (config.base.REPO_ROOT), then call runner.finalize_training.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

from eagle_pipeline import atomic
from eagle_pipeline.child_process import die_with_parent
from eagle_pipeline.config import TrainConfig
from eagle_pipeline.errors import BadInput, Terminated
from eagle_pipeline.train.runner import prepare, run_speculators
from eagle_pipeline.train.settings import TrainRun
from eagle_pipeline.train.stop import STOP_GRACE_S

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
        # After a stop, the ranks complete the checkpoint of an epoch whose training ended (train/stop.py).
        f"--shutdown-timeout={STOP_GRACE_S}",
        "-m",
        "eagle_pipeline.train.launch",
        str(launch_file),
    ]


def run_torchrun(command: list[str], cwd: Path) -> int:
    """Run torch.distributed.run to its end and return its exit code. It runs in a session of its own: a stop of
    this process (SIGTERM, Ctrl-C, to it or its process group) reaches torchrun once, from here, and torchrun
    passes it to its ranks (each in a session of its own too) and waits for them; the stop is raised here once
    torchrun has ended. Should this process be killed outright, torchrun gets SIGTERM from the kernel.

    Not a child_process.ChildProcess, which writes its child's output to a log file and SIGKILLs the child a grace
    period after a stop, or at a second one: torchrun's output belongs in the stage's own, and its ranks must be
    left to complete the epoch's checkpoint, which torchrun's --shutdown-timeout bounds."""
    process = subprocess.Popen(command, cwd=cwd, start_new_session=True, preexec_fn=die_with_parent)
    stop: BaseException | None = None
    while process.returncode is None:
        try:
            process.wait()
        except KeyboardInterrupt as e:  # Terminated too; a second one waits on: torchrun's timeout bounds it
            if stop is None:
                stop = e
                process.send_signal(signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT)
                print(f"stopping: the training ranks complete the epoch they are validating (up to {STOP_GRACE_S} s)",
                      flush=True)
    if stop is not None:
        raise stop
    return process.returncode


def read_launch_file(path: Path) -> tuple[TrainConfig, TrainRun]:
    values = json.loads(Path(path).read_text())
    return TrainConfig.model_validate(values["train"]), TrainRun(**values["run"])


def main(argv: list[str]) -> int:
    """One rank of a run that torchrun_command prepared."""
    import argparse

    parser = argparse.ArgumentParser(description="Run one training rank (started by torch.distributed.run).")
    parser.add_argument("launch_file", help=f"{LAUNCH_FILE} written by torchrun_command()")
    args = parser.parse_args(argv)
    try:
        run_speculators(*read_launch_file(Path(args.launch_file)))
    except KeyboardInterrupt:  # a stop, passed on by torchrun: stage 04 prints the `interrupted:` line
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
