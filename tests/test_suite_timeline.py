"""scripts/run_tests.sh --timeline: when each test file ran and on which worker (tests/conftest.py)."""

from __future__ import annotations

from types import SimpleNamespace

import conftest


def report(nodeid: str, start: float, stop: float, worker: str | None):
    node = SimpleNamespace(gateway=SimpleNamespace(id=worker)) if worker else None
    return SimpleNamespace(nodeid=nodeid, start=start, stop=stop, node=node)


def test_each_file_spans_its_first_start_to_its_last_stop_on_its_worker(monkeypatch):
    monkeypatch.setattr(conftest, "FILE_SPANS", {})
    for r in (report("tests/test_b.py::test_one", 110.0, 130.0, "gw1"), report("tests/test_a.py::test_one", 100.0, 105.0, "gw0"),
              report("tests/test_a.py::test_two", 105.0, 160.4, "gw0"), report("tests/test_b.py::test_two", 130.0, 131.0, "gw1"),
              SimpleNamespace(nodeid="tests/test_c.py::test_one")):  # a report without times (collection) is left out
        conftest.pytest_runtest_logreport(r)
    lines = []
    conftest.write_timeline(SimpleNamespace(write_line=lines.append))
    assert [line.split() for line in lines[1:]] == [["0", "60", "60", "gw0", "tests/test_a.py"],
                                                    ["10", "31", "21", "gw1", "tests/test_b.py"]]


def test_the_hand_out_order_names_only_test_files_that_exist():
    # A renamed file would silently drop to the end of the order.
    tests = conftest.REPO / "tests"
    assert [name for name in conftest.SMOKE_RUN_FILE_ORDER if not (tests / name).is_file()] == []


def test_files_keep_their_hand_out_order_and_each_leads_with_its_smoke_run_tests(tmp_path):
    def item(path, name, fixtures=(), vllm=False):
        markers = {"vllm"} if vllm else set()
        return SimpleNamespace(path=tmp_path / path, name=name, fixturenames=list(fixtures), add_marker=lambda m: None,
                               get_closest_marker=lambda marker: marker if marker in markers else None)

    items = [
        item("test_benchmarks.py", "fast_a"), item("test_benchmarks.py", "fast_b"),
        item("test_benchmarks.py", "quick", ["finished_small_run"], vllm=True),
        item("test_capture.py", "engine", vllm=True), item("test_config.py", "plain"),
        item("test_faults_01_03.py", "kill", ["small_run"], vllm=True),
    ]
    conftest.pytest_collection_modifyitems(None, None, items)
    assert [(i.path.name, i.name) for i in items] == [
        ("test_capture.py", "engine"), ("test_config.py", "plain"),
        ("test_faults_01_03.py", "kill"),
        ("test_benchmarks.py", "quick"), ("test_benchmarks.py", "fast_a"), ("test_benchmarks.py", "fast_b")]
