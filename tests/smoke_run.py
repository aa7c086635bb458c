"""The suite's one small pipeline run (configs/tiny-smoke.yaml), built once per test session and shared by every
test process of it.

Building it takes a few minutes, mostly vLLM engine starts. So as soon as a session has collected a test
that needs it, one background process (`python tests/smoke_run.py FOLDER`) builds it while the tests that do
not need it run; a test that needs it waits for the stages it reads. Under pytest-xdist every worker sees
the same folder (beside the workers' own temporary folders), and only the first one to ask starts the
build: the start is claimed by creating a file exclusively.

Folder layout: run.yaml (the smoke config with data_root inside the folder), data/t/ (the run), build.log,
and one marker per milestone: `stages-01-03.done`, `stages-04-06.done` or `failed` (with the reason).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
SMOKE_CONFIG = REPO / "configs" / "tiny-smoke.yaml"
RUN_NAME = "t"
FIRST_STAGES = ("01_generate_data.py", "02_extract_hidden.py", "03_build_vocab_map.py")
LAST_STAGES = ("04_train.py", "05_convert.py", "06_serve_test.py")
MILESTONES = {FIRST_STAGES: "stages-01-03.done", LAST_STAGES: "stages-04-06.done"}
STARTED = "build.started"
FAILED = "failed"
LOG = "build.log"
# The longest the whole build may take before a waiting test gives up (an AVX2-only CPU under a loaded
# suite takes about three times an idle AVX-512 one's ~4 minutes).
WAIT_LIMIT_S = 3600


def config_path(folder: Path) -> Path:
    return folder / "run.yaml"


def run_dir(folder: Path) -> Path:
    return folder / "data" / RUN_NAME


def write_config(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = config_path(folder)
    data = {"extends": str(SMOKE_CONFIG), "data_root": str(folder / "data"), "run_name": RUN_NAME}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(data))
    tmp.replace(path)
    return path


def stage_command(script: str, config: Path) -> list[str]:
    return [sys.executable, str(REPO / script), "--config", str(config)]


def stage_env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def build(folder: Path) -> int:
    """Run the six stages in order, marking each milestone; on a failure write FAILED naming the stage."""
    config = write_config(folder)
    with open(folder / LOG, "a") as log:
        for stages in (FIRST_STAGES, LAST_STAGES):
            for script in stages:
                log.write(f"==> {script}\n")
                log.flush()
                started = time.monotonic()
                result = subprocess.run(stage_command(script, config), cwd=REPO, env=stage_env(), stdout=log,
                                        stderr=subprocess.STDOUT, timeout=1800)
                log.write(f"<== {script}: exit {result.returncode} after {time.monotonic() - started:.0f} s\n")
                log.flush()
                if result.returncode != 0:
                    (folder / FAILED).write_text(f"{script} exited {result.returncode}")
                    return 1
            (folder / MILESTONES[stages]).touch()
    return 0


def start_in_background(folder: Path) -> bool:
    """Start the build unless another process of this session already has; True when this call started it."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        claim = os.open(folder / STARTED, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    process = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), str(folder)], cwd=REPO,
                               env=stage_env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    os.write(claim, str(process.pid).encode())
    os.close(claim)
    return True


def _builder_alive(folder: Path) -> bool:
    try:
        pid = int((folder / STARTED).read_text())
    except (OSError, ValueError):
        return True  # claimed a moment ago; the pid follows
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat")
    return not (state.exists() and state.read_text().rsplit(")", 1)[1].split()[0] == "Z")


def stop(folder: Path, grace_s: float = 30.0) -> None:
    """End a build that is still running (an interrupted session): SIGTERM to its process group, which lets a
    stage stop its vLLM servers, then SIGKILL after `grace_s`."""
    if not (folder / STARTED).exists() or (folder / MILESTONES[LAST_STAGES]).exists() or (folder / FAILED).exists():
        return
    try:
        pgid = int((folder / STARTED).read_text())
    except (OSError, ValueError):
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and _builder_alive(folder):
            time.sleep(0.5)


def wait_for(folder: Path, stages: tuple[str, ...]) -> Path:
    """Block until the build has finished `stages` (FIRST_STAGES or LAST_STAGES, which implies the first);
    start the build here if no process has. Return the run's config. Raise RuntimeError with the build log's
    tail when the build failed or died."""
    start_in_background(folder)
    marker = folder / MILESTONES[stages]
    deadline = time.monotonic() + WAIT_LIMIT_S
    while not marker.exists():
        failure = None
        if (folder / FAILED).exists():
            failure = (folder / FAILED).read_text()
        elif not _builder_alive(folder) and not marker.exists():
            failure = "the build process ended without finishing"
        elif time.monotonic() > deadline:
            failure = f"not finished after {WAIT_LIMIT_S} s"
        if failure:
            log = (folder / LOG).read_text(errors="replace") if (folder / LOG).exists() else ""
            raise RuntimeError(f"the shared smoke run in {folder} failed: {failure}\n{log[-6000:]}")
        time.sleep(1.0)
    return config_path(folder)


if __name__ == "__main__":
    sys.exit(build(Path(sys.argv[1])))
