"""Whether this host can run the pipeline's GPU build, checked before and after scripts/setup_env.sh installs it.

docs/gpu_host.md, "The preflight", says what each half checks. The half before installing
(`--before-install`) runs on whatever Python will build .venv, before any package is there: this module imports
only the standard library at the top (the config reader and torch are imported inside the after-install half) and
keeps to Python 3.7's syntax, so that an old system Python gets an error line instead of a syntax error.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from eagle_pipeline.errors import BadInput
from eagle_pipeline.gpus import NOT_ON_PATH
from eagle_pipeline.gpus import query as query_nvidia_smi

REPO_ROOT = Path(__file__).resolve().parent.parent
GPU_REQUIREMENTS = REPO_ROOT / "requirements" / "gpu.txt"
PYPROJECT = REPO_ROOT / "pyproject.toml"

# The CUDA version that PyPI's Linux wheel of each pinned torch release is built for (vLLM's wheel of the same
# release is built for the same one). tests/test_preflight.py checks that requirements/gpu.txt's pin is listed.
WHEEL_CUDA = {"2.13.0": "13.0"}
# The oldest driver branch each CUDA major version runs on (CUDA's minor-version compatibility).
MIN_DRIVER = {12: 525, 13: 580}
# CUDA 13 dropped Maxwell, Pascal and Volta: its libraries, and so the wheels built with it, start at Turing.
MIN_COMPUTE = {12: (5, 0), 13: (7, 5)}
# The least free /dev/shm this check lets through, not a measured need (docs/gpu_host.md says what uses it).
MIN_SHM_BYTES = 2 * 1024**3
SHM_PATH = "/dev/shm"
# .venv's CUDA build installed: an estimate from PyPI's wheel sizes, not a measured install (docs/gpu_host.md).
MIN_VENV_BYTES = 12 * 1024**3
# Starting one process per GPU, importing torch in each and setting NCCL up takes seconds to a minute; a hang
# in NCCL's set-up would otherwise never end.
ALL_REDUCE_TIMEOUT_S = 300.0
GPU_QUERY = ("driver_version", "compute_cap", "memory.total", "name")
# Drivers older than the compute_cap field refuse the whole query above; this one they answer.
OLD_DRIVER_QUERY = ("driver_version", "memory.total", "name")

Capability = Tuple[int, int]


@dataclass(frozen=True)
class Gpu:
    name: str
    driver: str
    compute: Optional[Capability]  # None where the driver is too old to report it
    memory_mib: Optional[int]


@dataclass(frozen=True)
class HostFacts:
    """What this host offers, read without any installed package."""

    python: Tuple[int, int, int]
    python_path: str
    in_venv: bool
    gpus: Tuple[Gpu, ...]
    nvidia_smi_problem: Optional[str]  # why nvidia-smi listed no GPUs; None when it did
    compiler: Optional[str]
    shm_path: str
    shm_free_bytes: Optional[int]  # None where the path does not exist
    # Where .venv is still to be made (this Python is not a virtual environment's): why `-m venv` would fail
    # (None: it works), and the room on the checkout's disk. Not checked inside a virtual environment.
    venv_problem: Optional[str] = None
    venv_disk_path: str = str(REPO_ROOT)
    venv_disk_free_bytes: Optional[int] = None


@dataclass(frozen=True)
class TorchFacts:
    """What the installed torch sees."""

    version: str
    cuda: Optional[str]  # torch.version.cuda; None for a CPU build
    available: bool
    unavailable_reason: str  # the warnings torch gave while CUDA failed to start ("" when none)
    devices: Tuple[Tuple[str, Capability], ...]  # name and compute capability of each visible device
    arch_list: Tuple[str, ...]  # torch.cuda.get_arch_list(): the architectures its kernels were built for


@dataclass(frozen=True)
class Requirements:
    """What the pinned GPU build needs, read from the files that pin it."""

    python: Tuple[int, int]
    torch: str
    vllm: str

    @property
    def wheel_cuda(self) -> Optional[str]:
        return WHEEL_CUDA.get(self.torch)

    def wheels(self, cuda: str) -> str:
        return f"the CUDA {cuda} wheels of torch {self.torch} / vllm {self.vllm}"


def read_requirements(requirements: Path = GPU_REQUIREMENTS, pyproject: Path = PYPROJECT) -> Requirements:
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", requirements.read_text(), re.M))
    python = re.search(r'^requires-python\s*=\s*">=\s*(\d+)\.(\d+)', pyproject.read_text(), re.M)
    if python is None or "torch" not in pins or "vllm" not in pins:
        raise ValueError(f"{requirements} must pin torch and vllm (==) and {pyproject} must set requires-python >=X.Y")
    return Requirements(python=(int(python.group(1)), int(python.group(2))), torch=pins["torch"], vllm=pins["vllm"])


# -- reading the host --------------------------------------------------------------------------------------


def _capability(text: str) -> Optional[Capability]:
    match = re.fullmatch(r"(\d+)\.(\d+)", text.strip())
    return (int(match.group(1)), int(match.group(2))) if match else None


def _leading_int(text: str) -> Optional[int]:
    """The number a field starts with: a memory figure's MiB, a driver version's branch."""
    match = re.match(r"\s*(\d+)", text)
    return int(match.group(1)) if match else None


def query_gpus() -> Tuple[Tuple[Gpu, ...], Optional[str]]:
    """The GPUs nvidia-smi lists, or why it listed none."""
    rows, problem = query_nvidia_smi(GPU_QUERY)
    if problem is not None and problem != NOT_ON_PATH:
        old_rows, old_problem = query_nvidia_smi(OLD_DRIVER_QUERY)
        if old_problem is None:  # no compute capability to report
            rows, problem = [[driver, "", memory, name] for driver, memory, name in old_rows], None
    return tuple(Gpu(name=name, driver=driver, compute=_capability(cap), memory_mib=_leading_int(memory))
                 for driver, cap, memory, name in rows), problem


def find_c_compiler() -> Optional[str]:
    """The C compiler Triton would build with: $CC, else gcc, else clang (triton/runtime/build.py)."""
    chosen = os.environ.get("CC")
    if chosen:
        return shutil.which(chosen)
    return shutil.which("gcc") or shutil.which("clang")


def shm_free_bytes(path: str, statvfs: Callable = os.statvfs) -> Optional[int]:
    try:
        stats = statvfs(path)
    except FileNotFoundError:
        return None
    return stats.f_bavail * stats.f_frsize


def venv_module_problem(python: str = sys.executable) -> Optional[str]:
    """Why `python -m venv` cannot make a virtual environment with pip in it, or None. It runs ensurepip, which
    Debian and Ubuntu leave out of their Python until python3-venv is installed."""
    try:
        result = subprocess.run([python, "-m", "ensurepip", "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{python} -m ensurepip could not run ({e})"
    if result.returncode != 0:
        said = [line.strip() for line in (result.stdout + result.stderr).splitlines() if line.strip()]
        return f"{python} -m ensurepip fails ({said[-1] if said else f'exit {result.returncode}'})"
    return None


def read_host_facts(shm_path: str = SHM_PATH, statvfs: Callable = os.statvfs) -> HostFacts:
    gpus, problem = query_gpus()
    in_venv = sys.prefix != sys.base_prefix
    return HostFacts(
        python=tuple(sys.version_info[:3]),
        python_path=sys.executable,
        in_venv=in_venv,
        gpus=gpus,
        nvidia_smi_problem=problem,
        compiler=find_c_compiler(),
        shm_path=shm_path,
        shm_free_bytes=shm_free_bytes(shm_path, statvfs),
        venv_problem=None if in_venv else venv_module_problem(),
        venv_disk_free_bytes=None if in_venv else shm_free_bytes(str(REPO_ROOT), statvfs),
    )


def read_torch_facts() -> TorchFacts:
    import warnings

    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
        count = torch.cuda.device_count() if available else 0
        devices = tuple((torch.cuda.get_device_name(i), tuple(torch.cuda.get_device_capability(i)))
                        for i in range(count))
        arch_list = tuple(torch.cuda.get_arch_list()) if available else ()
    reason = "; ".join(" ".join(str(w.message).split()) for w in caught)
    return TorchFacts(version=str(torch.__version__), cuda=torch.version.cuda, available=available,
                      unavailable_reason=reason[:400], devices=devices, arch_list=arch_list)


# -- judging -----------------------------------------------------------------------------------------------


def _size(n: int) -> str:
    return f"{n / 1024**3:.1f} GiB" if n >= 1024**3 else f"{n / 1024**2:.0f} MiB"


def _cuda_major(cuda: str) -> int:
    return int(cuda.split(".")[0])


def _gpu_list(gpus: Sequence[Tuple[str, Optional[Capability]]]) -> str:
    """'8x NVIDIA RTX PRO 6000 Blackwell Server Edition (compute 12.0)', one part per model."""
    counts = collections.Counter(gpus)
    return ", ".join(f"{n}x {name}" + (f" (compute {cap[0]}.{cap[1]})" if cap else "")
                     for (name, cap), n in counts.items())


def host_problems(host: HostFacts, req: Requirements, cuda: Optional[str]) -> List[str]:
    """What the host lacks for wheels built for CUDA `cuda` (the pinned wheels' before installing, the installed
    torch's after); None where that version is not known, which skips the driver and capability checks."""
    problems = []
    least = MIN_DRIVER.get(_cuda_major(cuda)) if cuda else None
    if host.python[:2] < req.python:
        have = ".".join(map(str, host.python))
        need = f"{req.python[0]}.{req.python[1]}"
        fix = (f"rebuild .venv with a newer Python: rm -rf .venv && PYTHON=python{need} scripts/setup_env.sh gpu"
               if host.in_venv
               else f"install Python {need} or newer (e.g. apt-get install python{need} python{need}-venv) and run "
                    f"PYTHON=python{need} scripts/setup_env.sh gpu")
        problems.append(f"Python {have} ({host.python_path}) is older than {need}, which pyproject.toml "
                        f"(requires-python) and vllm {req.vllm} need: {fix}")
    if host.nvidia_smi_problem is not None:
        driver = f"NVIDIA driver (R{least} or newer)" if least else "NVIDIA driver"
        problems.append(f"{host.nvidia_smi_problem}, so no NVIDIA GPU or driver can be found: install the {driver} "
                        f"and check that `nvidia-smi` lists the GPUs, or set up a CPU host "
                        f"with scripts/setup_env.sh cpu")
    elif not host.gpus:
        problems.append("nvidia-smi lists no GPU: check that the GPUs are visible to this user and container "
                        "(docker run --gpus all), or set up a CPU host with scripts/setup_env.sh cpu")
    if host.gpus and cuda is not None:
        driver = host.gpus[0].driver
        branch = _leading_int(driver)
        if branch is not None and least is not None and branch < least:
            problems.append(f"NVIDIA driver {driver} is older than R{least}, which {req.wheels(cuda)} need: update the "
                            f"driver to R{least} or newer (the distribution's nvidia-driver-{least} package or "
                            f"NVIDIA's installer), reboot, and check that nvidia-smi reports it")
        lowest = MIN_COMPUTE.get(_cuda_major(cuda))
        old = [(gpu.name, gpu.compute) for gpu in host.gpus
               if gpu.compute is not None and lowest is not None and gpu.compute < lowest]
        if old:
            problems.append(f"{_gpu_list(old)} below compute capability {lowest[0]}.{lowest[1]}, the oldest "
                            f"{req.wheels(cuda)} support: use GPUs of the Turing generation or newer")
    if host.compiler is None:
        named = (f"$CC ({os.environ['CC']}) is not on PATH" if os.environ.get("CC")
                 else "neither gcc nor clang is on PATH")
        problems.append(f"no C compiler: {named}, and Triton and vLLM's FlashInfer sampler compile kernels with one "
                        f"when an engine starts: install one (Debian/Ubuntu: sudo apt-get install build-essential; "
                        f"RHEL: sudo dnf install gcc gcc-c++), or set CC to a compiler")
    least = _size(MIN_SHM_BYTES)
    if host.shm_free_bytes is None:
        problems.append(f"{host.shm_path} does not exist; NCCL's shared-memory transport between PCIe GPUs needs it "
                        f"with at least {least} free: mount a tmpfs there (sudo mount -t tmpfs -o size=16g tmpfs "
                        f"{host.shm_path}), or in Docker start the container with --shm-size=16g or --ipc=host")
    elif host.shm_free_bytes < MIN_SHM_BYTES:
        problems.append(f"{host.shm_path} has {_size(host.shm_free_bytes)} free, below the {least} that NCCL's "
                        f"shared-memory transport between PCIe GPUs, vLLM's worker queues and the training data "
                        f"loaders need: in Docker start the container with --shm-size=16g or --ipc=host; on a host "
                        f"remount it larger (sudo mount -o remount,size=16G {host.shm_path}) or delete stale files of "
                        f"crashed runs from it")
    if host.in_venv:  # .venv is made already: what would stop setup_env.sh from making it is moot
        return problems
    if host.venv_problem is not None:
        version = f"{host.python[0]}.{host.python[1]}"
        problems.append(f"`{Path(host.python_path).name} -m venv` cannot make .venv: {host.venv_problem}: install "
                        f"Python's venv module (Debian/Ubuntu: sudo apt-get install python{version}-venv) and rerun")
    free = host.venv_disk_free_bytes
    if free is not None and free < MIN_VENV_BYTES:
        problems.append(f"{host.venv_disk_path} has {_size(free)} free, below the ~{_size(MIN_VENV_BYTES)} that "
                        f".venv's CUDA build takes (torch {req.torch} with its CUDA libraries, "
                        f"vllm {req.vllm}, FlashInfer, Triton; an estimate): free room on that disk, "
                        f"or put the checkout on a larger one")
    return problems


def _code_runs_on(arch: str, cap: Capability) -> bool:
    """Whether kernels built for `arch` (an entry of torch.cuda.get_arch_list()) run on a GPU of capability `cap`:
    machine code (sm_XY) runs on the same major version with an equal or newer minor one; PTX (compute_XY) is
    compiled for any newer GPU when loaded."""
    match = re.fullmatch(r"(sm|compute)_(\d+)(\d)[af]?", arch)
    if match is None:
        return False
    built = (int(match.group(2)), int(match.group(3)))
    return built <= cap if match.group(1) == "compute" else built[0] == cap[0] and built[1] <= cap[1]


def torch_problems(torch: TorchFacts, req: Requirements, gpus_needed: int, needed_by: str) -> List[str]:
    """What the installed torch cannot do here. `gpus_needed` is how many GPUs the config uses (0: no config)."""
    rebuild = "rm -rf .venv && scripts/setup_env.sh gpu"
    if torch.cuda is None:
        return [f".venv's torch {torch.version} is a CPU build (torch.version.cuda is None), so it cannot use the "
                f"GPUs: rebuild .venv for this GPU host: {rebuild}"]
    if not torch.available:
        why = f" ({torch.unavailable_reason})" if torch.unavailable_reason else ""
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        shown = f"CUDA_VISIBLE_DEVICES is {visible!r}" if visible is not None else "CUDA_VISIBLE_DEVICES is unset"
        return [f"torch.cuda.is_available() is False for torch {torch.version} (CUDA {torch.cuda}){why}: check "
                f"that nvidia-smi works for this user, that the driver is "
                f"R{MIN_DRIVER.get(_cuda_major(torch.cuda), '?')} or newer, "
                f"and that {shown} names GPUs that exist"]
    problems = []
    if len(torch.devices) < gpus_needed:
        problems.append(f"{needed_by} uses {gpus_needed} GPUs but torch sees {len(torch.devices)}: make more visible "
                        f"(CUDA_VISIBLE_DEVICES, docker run --gpus all) or free them, or lower "
                        f"verifier.tensor_parallel_size and train.num_gpus in the config")
    if torch.arch_list:
        unsupported = [(name, cap) for name, cap in torch.devices
                       if not any(_code_runs_on(a, cap) for a in torch.arch_list)]
        if unsupported:
            problems.append(f"torch {torch.version} has no kernels for {_gpu_list(unsupported)}: it was built for "
                            f"{' '.join(torch.arch_list)}; install the pinned build of requirements/gpu.txt, whose "
                            f"CUDA {req.wheel_cuda or torch.cuda} wheels cover it: {rebuild}")
    return problems


def all_reduce_problem(world_size: int, timeout_s: float = ALL_REDUCE_TIMEOUT_S,
                       command: Optional[Sequence[str]] = None) -> Optional[str]:
    """Run eagle_pipeline/allreduce_check.py across `world_size` GPUs (or `command` instead); None when it
    passed, else the error line."""
    shown = f"NCCL_DEBUG=INFO {Path(sys.executable).name} -m eagle_pipeline.allreduce_check {world_size}"
    command = list(command) if command else [sys.executable, "-m", "eagle_pipeline.allreduce_check", str(world_size)]
    what = f"a NCCL all-reduce across {world_size} GPU{'s' if world_size != 1 else ''}"
    # A session of its own, so that a timeout kills the rank processes too: hung in NCCL they would hold the GPUs.
    process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        return (f"{what} did not finish in {timeout_s:g} s: NCCL hung while it set up or moved the data; run it alone "
                f"to see where: {shown}")
    if process.returncode != 0:
        said = [line.strip() for line in output.splitlines() if line.strip()]
        return (f"{what} failed (exit {process.returncode}: {said[-1] if said else 'no output'}): run it alone to see "
                f"why: {shown}; a small /dev/shm, GPUs that another job holds, or NCCL_P2P_DISABLE/NCCL_SHM_DISABLE in "
                f"the environment are usual causes")
    return None


# -- the command line --------------------------------------------------------------------------------------


def gpus_used(config: str) -> Tuple[int, str, Dict[str, str]]:
    """How many GPUs a config's stages use at most, the words that say so, and the config's `env`."""
    from eagle_pipeline.config import load_config

    cfg = load_config(config)
    if cfg.device != "cuda":
        return 0, f"{config} (device {cfg.device})", dict(cfg.env)
    tp, train = cfg.verifier.tensor_parallel_size, cfg.train.num_gpus
    visible = f", CUDA_VISIBLE_DEVICES {cfg.env['CUDA_VISIBLE_DEVICES']}" if "CUDA_VISIBLE_DEVICES" in cfg.env else ""
    return (max(tp, train), f"{config} (verifier.tensor_parallel_size {tp}, train.num_gpus {train}{visible})",
            dict(cfg.env))


def main(argv: Optional[Sequence[str]] = None, *, read_host: Callable[[], HostFacts] = read_host_facts,
         read_torch: Callable[[], TorchFacts] = read_torch_facts,
         all_reduce: Callable[[int], Optional[str]] = all_reduce_problem) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle_pipeline.preflight", description=__doc__.split("\n\n")[0])
    parser.add_argument("--before-install", action="store_true",
                        help="only what needs no installed package (scripts/setup_env.sh runs this before installing)")
    parser.add_argument("--config",
                        help="a run config: torch must see the GPUs it uses, and the all-reduce runs across them")
    args = parser.parse_args(argv)
    if args.before_install and args.config:
        parser.error("--config needs the installed packages to read it; drop --before-install")

    req = read_requirements()
    host = read_host()
    if args.before_install:
        problems = host_problems(host, req, req.wheel_cuda)
        summary = None if problems else before_install_summary(host, req)
    else:
        problems, summary = after_install(host, req, args.config, read_torch, all_reduce)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if problems:
        return 2
    print(summary)
    return 0


def before_install_summary(host: HostFacts, req: Requirements) -> str:
    cuda = req.wheel_cuda
    least = MIN_DRIVER.get(_cuda_major(cuda)) if cuda else None
    driver = f"driver {host.gpus[0].driver}" + (f" (R{least}+ for {req.wheels(cuda)})" if least else "")
    return (f"preflight before install ok: Python {'.'.join(map(str, host.python))}, {driver}, "
            f"{_gpu_list([(g.name, g.compute) for g in host.gpus])}, C compiler {host.compiler}, "
            f"{host.shm_path} {_size(host.shm_free_bytes)} free"
            + ("" if host.in_venv or host.venv_disk_free_bytes is None else
               f", venv module ok, {host.venv_disk_path} {_size(host.venv_disk_free_bytes)} free for .venv"))


def after_install(host: HostFacts, req: Requirements, config: Optional[str], read_torch: Callable[[], TorchFacts],
                  all_reduce: Callable[[int], Optional[str]]) -> Tuple[List[str], Optional[str]]:
    problems = []
    needed, needed_by = 0, ""
    if config:
        try:
            needed, needed_by, env = gpus_used(config)
            # As the stages do (eagle_pipeline/stage.py): torch, asked next in this process, and the all-reduce's
            # ranks see the GPUs the run will use.
            os.environ.update(env)
        except BadInput as e:
            problems.append(str(e))
    try:
        torch = read_torch()
    except ImportError as e:
        failed = f"torch cannot be imported by {sys.executable} ({e}): build .venv with scripts/setup_env.sh gpu"
    except RuntimeError as e:  # CUDA started but a device could not be queried
        failed = (f"torch failed while asking the GPUs for their name and capability ({' '.join(str(e).split())}): "
                  f"check the GPUs with nvidia-smi -q (Xid errors in dmesg, a GPU fallen off the bus) and reboot if "
                  f"needed")
    else:
        failed = None
    if failed is not None:
        return problems + host_problems(host, req, req.wheel_cuda) + [failed], None
    problems += host_problems(host, req, torch.cuda or req.wheel_cuda)
    problems += torch_problems(torch, req, needed, needed_by)
    world = needed if config else len(torch.devices)
    if problems:
        return problems, None
    if world:
        problem = all_reduce(world)
        if problem:
            return [problem], None
    devices = _gpu_list([(name, cap) for name, cap in torch.devices])
    used = f"; {needed_by} uses {needed}" if config else ""
    reduced = f", NCCL all-reduce across {world} ok" if world else ""
    return [], (f"preflight ok: driver {host.gpus[0].driver}, CUDA {torch.cuda} (torch {torch.version}), "
                f"{devices}{used}, {host.shm_path} {_size(host.shm_free_bytes)} free{reduced}")


if __name__ == "__main__":
    sys.exit(main())
