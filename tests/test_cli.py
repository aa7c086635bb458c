"""The command-line contract: exit codes, one-line errors, --help, --dry-run without a model."""

import pytest
from conftest import SMOKE_CONFIG, run_stage, write_config

SCRIPTS = ["01_generate_data.py", "02_extract_hidden.py", "03_build_vocab_map.py"]
STAGE_SCRIPTS = [*SCRIPTS, "04_train.py", "05_convert.py", "06_serve_test.py"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_unknown_key_exits_2_with_one_error_line(tmp_path, script):
    config = write_config(tmp_path / "c.yaml", data_root=str(tmp_path / "d"), run_name="x", genration={"max_tokens": 3})
    result = run_stage(script, config)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "'genration'" in lines[0]


def test_missing_config_file(tmp_path):
    result = run_stage("01_generate_data.py", tmp_path / "absent.yaml")
    assert result.returncode == 2 and "absent.yaml: config file not found" in result.stderr


def test_later_stage_before_earlier_one_says_what_to_run(tiny_config):
    result = run_stage("03_build_vocab_map.py", tiny_config)
    assert result.returncode == 2 and "run 02_extract_hidden.py" in result.stderr


def test_dry_run_prints_plan_without_writing(tiny_config, tmp_path):
    result = run_stage("01_generate_data.py", tiny_config, "--dry-run")
    assert result.returncode == 0 and "generate 500 conversations" in result.stdout
    assert not (tmp_path / "data").exists()


def test_prompt_count_beyond_the_file_is_refused(tmp_path):
    # No budget: tiny.yaml's would refuse the disk that 100,000 samples plan first.
    config = write_config(tmp_path / "c.yaml", data_root=str(tmp_path / "d"), run_name="x", data={"num_samples": 100000},
                          disk_budget_gb=None)
    result = run_stage("01_generate_data.py", config, "--dry-run")
    assert result.returncode == 2 and "data.num_samples: 100000 exceeds" in result.stderr


def test_help_explains_options():
    import subprocess
    import sys

    from conftest import REPO

    out = subprocess.run([sys.executable, str(REPO / "01_generate_data.py"), "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--set" in out.stdout and "--force" in out.stdout and "--dry-run" in out.stdout


def test_every_dry_run_works_on_a_fresh_host_before_any_stage_has_run(tmp_path):
    # What a user checks before the first GPU minute: shapes, parallelism and disk, from the config alone.
    config = write_config(tmp_path / "c.yaml", base=SMOKE_CONFIG, data_root=str(tmp_path / "d"), run_name="x")
    outputs = {}
    for script in STAGE_SCRIPTS:
        result = run_stage(script, config, "--dry-run")
        assert result.returncode == 0, f"{script}: {result.stderr[-2000:]}"
        outputs[script] = result.stdout
    assert not (tmp_path / "d").exists(), "a dry run writes nothing"
    assert "has not run yet" in outputs["04_train.py"]
    assert "aux layer ids [2, 15, 27]" in outputs["04_train.py"] and "q_proj [576, 1152]" in outputs["04_train.py"]
    assert "[seq, 4, 576]" in outputs["02_extract_hidden.py"]
