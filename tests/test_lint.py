"""The repository passes its linter (ruff, configured in pyproject.toml) and installs as a package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_package_is_installed_from_this_checkout_not_found_through_sys_path_edits():
    # A fresh interpreter outside the repository finds the package through the editable install alone.
    code = "import eagle_pipeline, patches, bench; print(eagle_pipeline.__file__)"
    result = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert Path(result.stdout.strip()).resolve().parent.parent == REPO


def test_no_code_edits_the_import_path():
    offenders = [str(p.relative_to(REPO)) for p in REPO.rglob("*.py")
                 if ".venv" not in p.parts and "runs" not in p.parts and "sys.path.insert" in p.read_text(errors="replace")
                 and p.name != "test_lint.py"]
    assert not offenders, f"sys.path edits in {offenders}; the editable install (pyproject.toml) makes them unnecessary"
