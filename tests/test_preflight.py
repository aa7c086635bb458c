"""The GPU host preflight (eagle_pipeline/preflight.py) on a CPU machine: a stub nvidia-smi on PATH prints canned
CSV, /dev/shm's free room comes from a fake statvfs, and the installed torch's answers from a TorchFacts value.
scripts/setup_env.sh and scripts/remote.sh run in temporary copies, with a Python stub that lets only the
preflight through (with -S: no site-packages, as on a host before installing) and records anything else, so
that no test can start a pip install."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from conftest import REPO, process_alive

from eagle_pipeline import preflight
from eagle_pipeline.preflight import Gpu, TorchFacts

BLACKWELL = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
GOOD_ROW = f"580.65.06, 12.0, 97887, {BLACKWELL}"
OLD_ROW = f"550.54.14, 12.0, 97887, {BLACKWELL}"
REQ = preflight.read_requirements()
WHEELS = REQ.wheels(REQ.wheel_cuda)


def stub_nvidia_smi(folder: Path, rows: list[str], *, without_compute_cap: bool = False, list_exit: int = 0) -> Path:
    """An nvidia-smi that prints `rows` for --query-gpu and one line per row for -L (exit `list_exit`). With
    `without_compute_cap` it refuses queries naming compute_cap, as drivers older than that field do."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = " ".join(f"'{row}'" for row in rows)
    listed = " ".join(f"'GPU {i}: {row.rsplit(', ', 1)[-1]}'" for i, row in enumerate(rows))
    refuse = ('case "$*" in *compute_cap*) printf \'%s\\n\' \'Field "compute_cap" is not a valid field to query.\'; exit 2 ;; esac'
              if without_compute_cap else "")
    script = folder / "nvidia-smi"
    script.write_text(f"""#!/bin/sh
[ "$1" = -L ] && {{ printf '%s\\n' {listed}; exit {list_exit}; }}
{refuse}
printf '%s\\n' {lines}
""")
    script.chmod(0o755)
    return folder


def shm(free_bytes: int):
    """A statvfs that reports `free_bytes` free."""
    return lambda path: SimpleNamespace(f_bavail=free_bytes // 4096, f_frsize=4096)


@pytest.fixture
def gpu_host(tmp_path, monkeypatch):
    """PATH with a stub nvidia-smi (8 Blackwell GPUs on R580) in front; returns the stub's folder."""
    folder = stub_nvidia_smi(tmp_path / "bin", [GOOD_ROW] * 8)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return folder


def host_reader(free_bytes: int = 100 * 1024**3, shm_path: str = "/dev/shm"):
    return lambda: preflight.read_host_facts(shm_path=shm_path, statvfs=shm(free_bytes))


def torch_facts(count: int = 8, cap=(12, 0), arch=("sm_80", "sm_90", "sm_100", "sm_120"), available=True, cuda="13.0",
                reason="") -> TorchFacts:
    return TorchFacts(version="2.13.0+cu130", cuda=cuda, available=available, unavailable_reason=reason,
                      devices=tuple((BLACKWELL, cap) for _ in range(count)) if available else (), arch_list=arch if available else ())


def run_main(capsys, argv, **readers):
    code = preflight.main(argv, **readers)
    out, err = capsys.readouterr()
    return code, out.strip().splitlines(), err.strip().splitlines()


def error_lines(err: list[str]) -> list[str]:
    assert err and all(line.startswith("error: ") for line in err), err
    return err


# -- before installing -------------------------------------------------------------------------------------


def test_an_old_driver_is_one_error_line_naming_the_pinned_wheels_and_the_fix(gpu_host, capsys):
    stub_nvidia_smi(gpu_host, [OLD_ROW] * 8)
    code, out, err = run_main(capsys, ["--before-install"], read_host=host_reader())
    assert code == 2 and out == []
    assert error_lines(err) == [err[0]]
    assert f"NVIDIA driver 550.54.14 is older than R580, which {WHEELS} need: update the driver" in err[0]
    assert REQ.wheel_cuda == "13.0" and "torch 2.13.0 / vllm 0.32.0" in err[0]


def test_a_driver_too_old_to_report_compute_capability_is_still_judged(gpu_host, capsys):
    stub_nvidia_smi(gpu_host, [f"470.82.01, 81920, {BLACKWELL}"], without_compute_cap=True)
    host = preflight.read_host_facts(statvfs=shm(100 * 1024**3))
    assert host.gpus == (Gpu(name=BLACKWELL, driver="470.82.01", compute=None, memory_mib=81920),)
    code, _, err = run_main(capsys, ["--before-install"], read_host=lambda: host)
    assert code == 2 and len(error_lines(err)) == 1 and "NVIDIA driver 470.82.01 is older than R580" in err[0]


def test_no_c_compiler_on_path(gpu_host, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(gpu_host))  # the stub nvidia-smi and nothing else
    code, _, err = run_main(capsys, ["--before-install"], read_host=host_reader())
    assert code == 2 and len(error_lines(err)) == 1
    assert "no C compiler: neither gcc nor clang is on PATH" in err[0] and "build-essential" in err[0]
    monkeypatch.setenv("CC", "/nowhere/cc")
    _, _, err = run_main(capsys, ["--before-install"], read_host=host_reader())
    assert "$CC (/nowhere/cc) is not on PATH" in err[0]


def test_a_small_or_missing_dev_shm(gpu_host, tmp_path, capsys):
    code, _, err = run_main(capsys, ["--before-install"], read_host=host_reader(free_bytes=64 * 1024**2))
    assert code == 2 and len(error_lines(err)) == 1
    assert "/dev/shm has 64 MiB free, below the 2.0 GiB" in err[0] and "--shm-size=16g or --ipc=host" in err[0]
    missing = tmp_path / "no-shm"
    code, _, err = run_main(capsys, ["--before-install"],
                            read_host=lambda: preflight.read_host_facts(shm_path=str(missing)))
    assert code == 2 and err == [f"error: {missing} does not exist; NCCL's shared-memory transport between PCIe GPUs needs it "
                                 f"with at least 2.0 GiB free: mount a tmpfs there (sudo mount -t tmpfs -o size=16g tmpfs "
                                 f"{missing}), or in Docker start the container with --shm-size=16g or --ipc=host"]


def test_every_failure_is_listed_not_just_the_first(gpu_host, monkeypatch, capsys):
    stub_nvidia_smi(gpu_host, ["550.54.14, 7.0, 16384, Tesla V100-SXM2-16GB"] * 2)
    monkeypatch.setenv("PATH", str(gpu_host))
    code, out, err = run_main(capsys, ["--before-install"], read_host=host_reader(free_bytes=64 * 1024**2))
    assert code == 2 and out == []
    assert [line.split(":")[1].split()[0] for line in error_lines(err)] == ["NVIDIA", "2x", "no", "/dev/shm"]
    assert "2x Tesla V100-SXM2-16GB (compute 7.0) below compute capability 7.5" in err[1]


def test_without_nvidia_smi_the_gpu_preflight_says_what_to_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    code, _, err = run_main(capsys, ["--before-install"], read_host=host_reader())
    assert code == 2 and err[0].startswith("error: nvidia-smi is not on PATH, so no NVIDIA GPU or driver can be found: "
                                           "install the NVIDIA driver (R580 or newer)")


def test_a_python_older_than_pyproject_requires(gpu_host, capsys):
    old = dataclasses.replace(host_reader()(), python=(3, 10, 12), in_venv=False)
    code, _, err = run_main(capsys, ["--before-install"], read_host=lambda: old)
    assert code == 2 and len(err) == 1
    assert "Python 3.10.12" in err[0] and "older than 3.11" in err[0] and "PYTHON=python3.11 scripts/setup_env.sh gpu" in err[0]


def test_a_good_host_prints_one_summary_line_before_installing(gpu_host, capsys):
    code, out, err = run_main(capsys, ["--before-install"], read_host=host_reader())
    assert code == 0 and err == []
    assert out == [f"preflight before install ok: Python {'.'.join(map(str, sys.version_info[:3]))}, driver 580.65.06 "
                   f"(R580+ for {WHEELS}), 8x {BLACKWELL} (compute 12.0), C compiler {shutil.which('gcc') or shutil.which('clang')}, "
                   f"/dev/shm 100.0 GiB free"]


def test_a_python_without_its_venv_module_or_a_small_disk_is_refused_before_installing(gpu_host, tmp_path, capsys):
    # A system Python (not a virtual environment's), as setup_env.sh runs it before .venv exists.
    fresh = dataclasses.replace(host_reader()(), python=(3, 11, 2), python_path="/usr/bin/python3", in_venv=False,
                                venv_disk_path="/srv/checkout",
                                venv_disk_free_bytes=50 * 1024**3)
    code, out, err = run_main(capsys, ["--before-install"], read_host=lambda: fresh)
    assert code == 0 and out[0].endswith(", venv module ok, /srv/checkout 50.0 GiB free for .venv")
    broken = dataclasses.replace(fresh, venv_problem="/usr/bin/python3 -m ensurepip fails (No module named ensurepip)",
                                 venv_disk_free_bytes=5 * 1024**3)
    code, out, err = run_main(capsys, ["--before-install"], read_host=lambda: broken)
    assert code == 2 and out == [] and len(error_lines(err)) == 2
    assert err[0].startswith("error: `python3 -m venv` cannot make .venv: /usr/bin/python3 -m ensurepip fails (No module "
                             "named ensurepip): install Python's venv module (Debian/Ubuntu: sudo apt-get install "
                             "python3.11-venv)")
    assert err[1].startswith("error: /srv/checkout has 5.0 GiB free, below the ~12.0 GiB that .venv's CUDA build takes")
    # Inside a virtual environment (.venv made already) neither is asked.
    code, _, _ = run_main(capsys, ["--before-install"], read_host=lambda: dataclasses.replace(broken, in_venv=True))
    assert code == 0


def test_the_venv_module_is_asked_of_the_python_that_will_make_venv(tmp_path):
    assert preflight.venv_module_problem(sys.executable) is None
    debian = tmp_path / "python3"  # Debian's Python without python3-venv
    debian.write_text("#!/bin/sh\necho '/usr/bin/python3: No module named ensurepip' >&2\nexit 1\n")
    debian.chmod(0o755)
    assert preflight.venv_module_problem(str(debian)) == f"{debian} -m ensurepip fails (/usr/bin/python3: No module named ensurepip)"


def test_the_cuda_of_the_pinned_torch_wheels_is_known():
    # A new torch pin in requirements/gpu.txt needs its wheels' CUDA version in preflight.WHEEL_CUDA, and that
    # CUDA major version's driver and compute capability floors.
    assert REQ.wheel_cuda is not None, f"add torch {REQ.torch}'s wheel CUDA version to eagle_pipeline/preflight.py WHEEL_CUDA"
    major = int(REQ.wheel_cuda.split(".")[0])
    assert major in preflight.MIN_DRIVER and major in preflight.MIN_COMPUTE


# -- after installing --------------------------------------------------------------------------------------


@pytest.fixture
def kimi_config(tmp_path):
    """configs/kimi-k2.5.yaml: tensor parallel 8, 8 training GPUs."""
    def make(**overrides):
        path = tmp_path / "kimi.yaml"
        path.write_text(yaml.safe_dump({"extends": str(REPO / "configs" / "kimi-k2.5.yaml"), **overrides}))
        return str(path)
    return make


def refuse_all_reduce(world_size):
    raise AssertionError("the all-reduce must not run when a requirement already failed")


def test_fewer_gpus_than_tensor_parallel_size(gpu_host, kimi_config, capsys):
    config = kimi_config(train={"num_gpus": 2})
    code, out, err = run_main(capsys, ["--config", config], read_host=host_reader(),
                              read_torch=lambda: torch_facts(count=4), all_reduce=refuse_all_reduce)
    assert code == 2 and out == []
    assert err == [f"error: {config} (verifier.tensor_parallel_size 8, train.num_gpus 2) uses 8 GPUs but torch sees 4: "
                   f"make more visible (CUDA_VISIBLE_DEVICES, docker run --gpus all) or free them, or lower "
                   f"verifier.tensor_parallel_size and train.num_gpus in the config"]


def test_torch_cuda_unavailable(gpu_host, capsys):
    reason = "CUDA initialization: The NVIDIA driver on your system is too old (found version 12080)."
    code, _, err = run_main(capsys, [], read_host=host_reader(), read_torch=lambda: torch_facts(available=False, reason=reason),
                            all_reduce=refuse_all_reduce)
    assert code == 2 and len(error_lines(err)) == 1
    assert err[0].startswith(f"error: torch.cuda.is_available() is False for torch 2.13.0+cu130 (CUDA 13.0) ({reason}): ")
    assert "CUDA_VISIBLE_DEVICES is unset" in err[0]


def test_a_cpu_build_of_torch_in_the_venv(gpu_host, capsys):
    code, _, err = run_main(capsys, [], read_host=host_reader(), read_torch=lambda: torch_facts(cuda=None),
                            all_reduce=refuse_all_reduce)
    assert code == 2 and len(err) == 1 and "is a CPU build" in err[0] and "rm -rf .venv && scripts/setup_env.sh gpu" in err[0]


def test_a_compute_capability_the_installed_torch_has_no_kernels_for(gpu_host, capsys):
    code, _, err = run_main(capsys, [], read_host=host_reader(), read_torch=lambda: torch_facts(arch=("sm_80", "sm_90")),
                            all_reduce=refuse_all_reduce)
    assert code == 2 and len(error_lines(err)) == 1
    assert err[0].startswith(f"error: torch 2.13.0+cu130 has no kernels for 8x {BLACKWELL} (compute 12.0): it was built for sm_80 sm_90")


@pytest.mark.parametrize("arch, cap, runs", [
    ("sm_120", (12, 0), True),
    ("sm_80", (8, 6), True),       # machine code runs on a newer minor version of its major one
    ("sm_86", (8, 0), False),
    ("sm_90", (12, 0), False),     # but not on another major version
    ("compute_90", (12, 0), True),  # PTX is compiled for any newer GPU
    ("compute_120", (9, 0), False),
    ("sm_100a", (10, 0), True),
])
def test_which_kernels_run_on_which_gpu(arch, cap, runs):
    assert preflight._code_runs_on(arch, cap) is runs


def test_a_good_host_prints_one_summary_line_after_the_all_reduce(gpu_host, kimi_config, capsys):
    worlds = []
    config = kimi_config()
    code, out, err = run_main(capsys, ["--config", config], read_host=host_reader(), read_torch=torch_facts,
                              all_reduce=lambda world: worlds.append(world))
    assert code == 0 and err == [] and worlds == [8]
    assert out == [f"preflight ok: driver 580.65.06, CUDA 13.0 (torch 2.13.0+cu130), 8x {BLACKWELL} (compute 12.0); {config} "
                   f"(verifier.tensor_parallel_size 8, train.num_gpus 8) uses 8, /dev/shm 100.0 GiB free, NCCL all-reduce across 8 ok"]
    # Without a config it reports what torch sees and reduces across all of it.
    code, out, _ = run_main(capsys, [], read_host=host_reader(), read_torch=lambda: torch_facts(count=2),
                            all_reduce=lambda world: worlds.append(world))
    assert code == 0 and worlds == [8, 2] and f"2x {BLACKWELL} (compute 12.0), /dev/shm" in out[0]


def test_the_configs_env_picks_the_gpus_torch_and_the_all_reduce_see(gpu_host, kimi_config, monkeypatch, capsys):
    seen = {}
    config = kimi_config(env={"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, verifier={"tensor_parallel_size": 4}, train={"num_gpus": 4})

    def torch_sees():
        seen["torch"] = os.environ.get("CUDA_VISIBLE_DEVICES")
        return torch_facts(count=4)

    code, out, err = run_main(capsys, ["--config", config], read_host=host_reader(), read_torch=torch_sees,
                              all_reduce=lambda world: seen.update(all_reduce=(world, os.environ.get("CUDA_VISIBLE_DEVICES"))))
    assert code == 0 and err == [], err
    assert seen == {"torch": "4,5,6,7", "all_reduce": (4, "4,5,6,7")}
    assert "train.num_gpus 4, CUDA_VISIBLE_DEVICES 4,5,6,7) uses 4" in out[0]


def test_a_failed_all_reduce_fails_the_preflight(gpu_host, capsys):
    line = "a NCCL all-reduce across 8 GPUs failed (exit 1: ...)"
    code, out, err = run_main(capsys, [], read_host=host_reader(), read_torch=torch_facts, all_reduce=lambda world: line)
    assert code == 2 and out == [] and err == [f"error: {line}"]


def test_a_bad_config_is_listed_with_the_other_failures(gpu_host, tmp_path, capsys):
    config = tmp_path / "missing.yaml"
    code, _, err = run_main(capsys, ["--config", str(config)], read_host=host_reader(free_bytes=1024**2),
                            read_torch=torch_facts, all_reduce=refuse_all_reduce)
    assert code == 2 and len(error_lines(err)) == 2 and str(config) in err[0] and "/dev/shm has 1 MiB free" in err[1]


# -- the all-reduce ----------------------------------------------------------------------------------------


def test_the_all_reduce_launcher_reports_success_failure_and_a_hang(tmp_path):
    assert preflight.all_reduce_problem(8, command=[sys.executable, "-c", "print('fine')"]) is None

    failing = "import sys; print('NCCL WARN something'); print('error: rank 3 lost', file=sys.stderr); sys.exit(3)"
    problem = preflight.all_reduce_problem(8, command=[sys.executable, "-c", failing])
    assert problem.startswith("a NCCL all-reduce across 8 GPUs failed (exit 3: error: rank 3 lost): run it alone to see why: "
                              "NCCL_DEBUG=INFO ")
    assert "-m eagle_pipeline.allreduce_check 8" in problem

    # A hang, with a rank process below the launched one: both are killed when the time is up.
    rank_pid = tmp_path / "rank.pid"
    hang = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"open({str(rank_pid)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    start = time.monotonic()
    problem = preflight.all_reduce_problem(2, timeout_s=3, command=[sys.executable, "-c", hang])
    assert time.monotonic() - start < 30
    assert problem.startswith("a NCCL all-reduce across 2 GPUs did not finish in 3 s")
    pid = int(rank_pid.read_text())
    deadline = time.monotonic() + 10
    while process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not process_alive(pid)


def test_the_all_reduce_check_itself_on_cpu_processes():
    # The same module the preflight launches, with gloo instead of NCCL: spawn, rendezvous, reduce, compare.
    result = subprocess.run([sys.executable, "-m", "eagle_pipeline.allreduce_check", "2", "--backend", "gloo"], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("all-reduce (gloo) across 2 CPU processes: every rank got 3,")


# -- scripts/setup_env.sh and scripts/remote.sh ------------------------------------------------------------


def checkout_copy(folder: Path) -> Path:
    """What setup_env.sh reads, copied, without .venv."""
    folder.mkdir()
    for name in ("scripts", "requirements", "eagle_pipeline"):
        shutil.copytree(REPO / name, folder / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", folder)
    return folder


def python_stub(folder: Path) -> tuple[Path, Path]:
    """A Python that runs only the preflight (without site-packages) and records any other call, e.g. `-m venv`."""
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "other-calls.log"
    stub = folder / "python3"
    stub.write_text(f"""#!/bin/sh
case "$*" in *eagle_pipeline.preflight*) exec {sys.executable} -S "$@" ;; esac
echo "$*" >> {log}
exit 1
""")
    stub.chmod(0o755)
    return stub, log


@pytest.mark.parametrize("args", [["gpu"], []], ids=["gpu", "autodetected"])
def test_setup_env_stops_on_an_old_driver_before_installing(tmp_path, args):
    copy = checkout_copy(tmp_path / "checkout")
    stubs = stub_nvidia_smi(tmp_path / "bin", [OLD_ROW] * 8)
    python, log = python_stub(tmp_path / "py")
    env = {**os.environ, "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}", "PYTHON": str(python)}
    result = subprocess.run([str(copy / "scripts" / "setup_env.sh"), *args], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.splitlines()[0].startswith("error: NVIDIA driver 550.54.14 is older than R580"), result.stderr
    assert "setting up .venv" not in result.stderr
    assert not (copy / ".venv").exists() and not log.exists(), "the script went on to install"


def test_setup_env_without_a_gpu_stays_instant_when_its_stamp_matches(tmp_path):
    copy = checkout_copy(tmp_path / "checkout")
    stubs = stub_nvidia_smi(tmp_path / "bin", [OLD_ROW], list_exit=9)  # nvidia-smi there, but it sees no GPU
    python, log = python_stub(tmp_path / "py")
    digest = hashlib.sha256(b"".join((copy / name).read_bytes()
                                     for name in ("requirements/common.txt", "requirements/cpu.txt", "pyproject.toml")))
    (copy / ".venv").mkdir()
    (copy / ".venv" / ".installed").write_text(f"cpu {digest.hexdigest()[:16]} {copy}\n")
    env = {**os.environ, "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}", "PYTHON": str(python)}
    result = subprocess.run([str(copy / "scripts" / "setup_env.sh")], env=env, capture_output=True, text=True, timeout=30)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
    assert not log.exists()


def test_remote_setup_reports_the_failed_preflight(tmp_path):
    stubs = stub_nvidia_smi(tmp_path / "bin", [OLD_ROW] * 8)
    python, log = python_stub(tmp_path / "py")
    host = tmp_path / "host"
    env = {**os.environ, "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}", "PYTHON": str(python),
           "EAGLE_HOST": "local", "EAGLE_REMOTE_DIR": str(host)}
    result = subprocess.run([str(REPO / "scripts" / "remote.sh"), "setup", "--follow"], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "error: NVIDIA driver 550.54.14 is older than R580" in result.stdout
    assert "== setup_env.sh exited 2" in result.stdout
    assert "error: setup failed (exit 2)" in result.stderr
    assert not (host / ".venv").exists() and not log.exists()
