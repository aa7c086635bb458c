"""Shared fixtures: the repository root, the Python that runs stage scripts, small configs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import smoke_run
import yaml

REPO = Path(__file__).resolve().parent.parent


TINY_CONFIG = REPO / "configs" / "tiny.yaml"
# The suite's one small pipeline run (tests/smoke_run.py): 6 conversations of at most 24 tokens, short
# training and serving, an acceptance floor any drafter passes. It is also what users get as their first try.
SMOKE_CONFIG = smoke_run.SMOKE_CONFIG
SMOKE = yaml.safe_load(SMOKE_CONFIG.read_text())


def write_config(path: Path, base: Path = TINY_CONFIG, **overrides) -> Path:
    """A config file that extends `base` (configs/tiny.yaml) with nested overrides."""
    data = {"extends": str(base), **overrides}
    path.write_text(yaml.safe_dump(data))
    return path


def write_smoke_config(path: Path, **overrides) -> Path:
    """A config file that extends configs/tiny-smoke.yaml with nested overrides."""
    return write_config(path, base=SMOKE_CONFIG, **overrides)


def run_stage(script: str, config: Path, *args: str, timeout: int = 900,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, str(REPO / script), "--config", str(config), *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
    )


def stage_module(script: str):
    """A stage script loaded as a module, to run its command line in this process: `stage.main(n, m.__doc__, m.run, argv)`."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"stage_script_{script[:2]}", REPO / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def tiny_config(tmp_path: Path) -> Path:
    return write_config(tmp_path / "run.yaml", data_root=str(tmp_path / "data"), run_name="t")


def skip_without_bf16_matmul() -> None:
    """Skip, saying why, on a CPU where torch has no bf16 matmul kernel. vLLM's CPU linear layers fall back
    from oneDNN (which has no bf16 matmul on AVX2-only CPUs) to torch's kernel, so a bf16 engine fails only
    when that one is missing too."""
    from bench.flops import unavailable_matmul_kernels

    missing = unavailable_matmul_kernels("bfloat16")
    if "torch" in missing:
        pytest.skip(f"a bf16 vLLM engine cannot run here: torch matmul {missing['torch']}")


def process_alive(pid: int) -> bool:
    """True while the process runs; a zombie (exited, its parent not yet reaping it) counts as ended."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:  # gone
        return False
    return state not in ("Z", "X")


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def pytest_configure(config: pytest.Config) -> None:
    """A pytest-xdist worker keeps to its own share of the cores, and so does everything it starts (vLLM binds
    its threads to the cores a process may use, torch sizes its thread pool by them). Two workers on one
    machine's cores would otherwise each start two-thread engines on both, whose threads spin waiting for each
    other: measured on 2 cores, some tests took 2.8x their time alone, and the whole suite 1.5x as long as with
    a core each (BENCHMARKS.md section 9)."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    workers, index = int(workerinput["workercount"]), int(workerinput["workerid"].removeprefix("gw"))
    share = len(cores) // workers
    if share >= 1:
        os.sched_setaffinity(0, cores[index * share:(index + 1) * share])
    else:  # more workers than cores: each on one core, taking turns
        os.sched_setaffinity(0, [cores[index % len(cores)]])


def smoke_folder(config: pytest.Config) -> Path:
    """Where the session's shared smoke run lives: beside the pytest-xdist workers' own temporary folders
    (so every worker of the session finds the same one), or in the session's temporary folder without xdist."""
    base = config._tmp_path_factory.getbasetemp()  # the tmp_path_factory fixture's own object, for use in hooks
    return (base.parent if hasattr(config, "workerinput") else base) / "smoke"


def needs_smoke_run(item: pytest.Item) -> bool:
    return bool({"small_run", "finished_small_run"} & set(getattr(item, "fixturenames", ())))


# The files that need the shared smoke run, in the order they are handed out. pytest-xdist gives a worker its
# next file as soon as two tests of its current one are left: for the fault files (four tests of minutes each)
# that is minutes ahead, so they go first, where handing out early costs nothing; the one that needs only stages
# 01-03 leads, so that a worker which gets there before the build has finished does not wait for it. The two
# longest files follow, and the files of many short tests come last, where whichever worker frees first takes
# them and neither ends the session alone (BENCHMARKS.md section 9).
SMOKE_RUN_FILE_ORDER = ("test_faults_01_03.py", "test_faults_04_06.py", "test_benchmarks.py", "test_diagnosis.py",
                        "test_corruption.py", "test_stages_01_03.py", "test_stages_04_06.py", "test_finetune.py")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test that needs the shared smoke run `slow` (it waits for a build of several minutes), and
    order the test files for the workers (scripts/run_tests.sh: pytest-xdist, `--dist loadfile`, which hands
    each file to one worker as a whole, in this order). Files none of whose tests need the shared smoke run go
    first, so that they run while it is being built, and among them the files that start vLLM engines lead, so
    that a long one does not end the session alone; the files that need it follow in SMOKE_RUN_FILE_ORDER.
    (Fault injection, the longest, is split over two files.) Within a file the tests that need the smoke run
    (the long ones) go first: a worker is handed its next file when two tests of its current one are left, and
    with a minutes-long test among those two it would claim a file the other worker is about to be free for
    (the quick benchmark, last in its file, did so). Measured against other orders in BENCHMARKS.md section 9."""
    needs_smoke, starts_engines = set(), set()
    for item in items:
        if needs_smoke_run(item):
            item.add_marker(pytest.mark.slow)
            needs_smoke.add(item.path)
        if item.get_closest_marker("vllm") is not None:
            starts_engines.add(item.path)

    def rank(path: Path) -> int:
        if path in needs_smoke and path.name in SMOKE_RUN_FILE_ORDER:
            return SMOKE_RUN_FILE_ORDER.index(path.name)
        return len(SMOKE_RUN_FILE_ORDER) + (path not in starts_engines)

    # pytest collects the files in name order, so sorting by path within a rank keeps each file together.
    items.sort(key=lambda item: (item.path in needs_smoke, rank(item.path), item.path, not needs_smoke_run(item)))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start building the shared smoke run as soon as a selected test needs it (after -k / -m deselection).
    The build shares the core of the worker that starts it, which measured faster than giving it a worker of
    its own (BENCHMARKS.md section 9)."""
    if not session.config.option.collectonly and any(needs_smoke_run(item) for item in session.items):
        smoke_run.start_in_background(smoke_folder(session.config))


def _fuzz_cases_tried() -> int:
    fuzz = sys.modules.get("test_schema_fuzz")
    return fuzz.CASES_TRIED[0] if fuzz is not None else 0


FUZZ_CASES_FROM_WORKERS = [0]


def pytest_sessionfinish(session: pytest.Session) -> None:
    if hasattr(session.config, "workerinput"):
        # A pytest-xdist worker hands its count to the controlling process (pytest_testnodedown).
        session.config.workeroutput["fuzz_cases_tried"] = _fuzz_cases_tried()
        return
    # The controlling process, which outlives every worker: an interrupted session leaves no smoke build
    # behind (it runs in a process session of its own).
    smoke_run.stop(smoke_folder(session.config))


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook
def pytest_testnodedown(node, error) -> None:
    FUZZ_CASES_FROM_WORKERS[0] += getattr(node, "workeroutput", {}).get("fuzz_cases_tried", 0)


@pytest.fixture(scope="session")
def small_run(request):
    """Stages 01-03 of the shared smoke run: (folder, config, run_dir)."""
    folder = smoke_folder(request.config)
    config = smoke_run.wait_for(folder, smoke_run.FIRST_STAGES)
    return folder, config, smoke_run.run_dir(folder)


@pytest.fixture(scope="session")
def finished_small_run(request):
    """The shared smoke run with all six stages done: (config, run_dir)."""
    folder = smoke_folder(request.config)
    config = smoke_run.wait_for(folder, smoke_run.LAST_STAGES)
    return config, smoke_run.run_dir(folder)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--timeline", action="store_true",
                     help="end with when each test file ran and on which worker (BENCHMARKS.md section 9)")


# With --timeline, each test file's first start, last stop and worker, from the reports of its tests.
FILE_SPANS: dict[str, dict] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not hasattr(report, "start"):
        return
    span = FILE_SPANS.setdefault(report.nodeid.split("::")[0], {"start": report.start, "stop": report.stop, "worker": "main"})
    span["start"], span["stop"] = min(span["start"], report.start), max(span["stop"], report.stop)
    node = getattr(report, "node", None)  # set by pytest-xdist in the controlling process
    if node is not None:
        span["worker"] = node.gateway.id


def write_timeline(terminalreporter) -> None:
    if not FILE_SPANS:
        return
    began = min(span["start"] for span in FILE_SPANS.values())
    terminalreporter.write_line("timeline (s from the first test's start): start  end  seconds  worker  file")
    for name, span in sorted(FILE_SPANS.items(), key=lambda item: item[1]["start"]):
        terminalreporter.write_line(f"{span['start'] - began:7.0f} {span['stop'] - began:7.0f} {span['stop'] - span['start']:7.0f}"
                                    f"  {span['worker']}  {name}")


def pytest_terminal_summary(terminalreporter, config: pytest.Config):
    """How many generated bad-input cases tests/test_schema_fuzz.py tried (the figure BENCHMARKS.md quotes);
    with --timeline, when each test file ran."""
    tried = _fuzz_cases_tried() + FUZZ_CASES_FROM_WORKERS[0]
    if tried:
        terminalreporter.write_line(f"schema fuzz: {tried} generated bad-input cases tried")
    if config.getoption("timeline"):
        write_timeline(terminalreporter)
