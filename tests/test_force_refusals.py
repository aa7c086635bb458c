"""`--force` deletes a stage's output only after every check the stage can make has passed: for each class of
refusal, the finished stage folder is byte for byte what it was, and no "running" manifest appears. The
dry run makes the same checks."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from conftest import copy_of_run, run_stage_in_process, without_log_records


@pytest.fixture(scope="module")
def run(finished_small_run, tmp_path_factory):
    """A copy of the finished smoke run: (config, run_dir)."""
    return copy_of_run(finished_small_run[1], tmp_path_factory.mktemp("force"), "f")


def folder_bytes(folder: Path) -> dict[str, str]:
    """sha256 of every file of a stage folder (its logs aside: a refusal may say why there)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and "logs" not in p.relative_to(folder).parts}


def write_bad_drafter(folder: Path, problem: str) -> Path:
    """A flat drafter folder with one fault: NaN weights, or a torn weights file."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 576,
                                                    "vocab_size": 49152, "draft_vocab_size": 256}))
    weights = {"midlayer.mlp.down_proj.weight": torch.full((576, 8), float("nan")),
               "d2t": torch.zeros(256, dtype=torch.long), "t2d": torch.zeros(49152, dtype=torch.bool)}
    save_file(weights, str(folder / "model.safetensors"))
    if problem == "torn":
        data = (folder / "model.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    return folder


CASES = [
    # (name, stage script, --set overrides given a scratch folder, what the error line says)
    ("partial-draft-shape", "04_train.py", lambda tmp: ["train.draft_shape.num_attention_heads=8"], "train.draft_shape: missing keys"),
    ("draft-hidden-size", "04_train.py",
     lambda tmp: ["train.draft_shape={hidden_size: 1024, num_attention_heads: 8, num_key_value_heads: 2, head_dim: 64, "
                  "intermediate_size: 1536}"], "train.draft_shape.hidden_size: 1024 differs"),
    ("init-from-missing", "04_train.py", lambda tmp: [f"train.init_from={tmp / 'nowhere'}"], "train.init_from"),
    ("from-drafter-missing", "03_build_vocab_map.py", lambda tmp: [f"vocab.from_drafter={tmp / 'nowhere'}"], "vocab.from_drafter"),
    ("layer-id-out-of-range", "02_extract_hidden.py", lambda tmp: ["hidden_states.layer_ids=[2,15,99]"], "hidden_states.layer_ids"),
    ("init-from-nan-weights", "04_train.py", lambda tmp: [f"train.init_from={write_bad_drafter(tmp / 'nan', 'nan')}"],
     "holds 4608 NaN or infinite values"),
    ("init-from-torn-weights", "04_train.py", lambda tmp: [f"train.init_from={write_bad_drafter(tmp / 'torn', 'torn')}"],
     "the file is torn or not safetensors"),
    ("from-drafter-nan-weights", "03_build_vocab_map.py",
     lambda tmp: [f"vocab.from_drafter={write_bad_drafter(tmp / 'nan', 'nan')}"], "vocab.from_drafter"),
    ("serve-drafter-nan-weights", "06_serve_test.py", lambda tmp: [f"serve.drafter={write_bad_drafter(tmp / 'nan', 'nan')}"],
     "serve.drafter"),
    ("reference-dir-missing", "05_convert.py", lambda tmp: [f"convert.reference_dir={tmp / 'nowhere'}"], "convert.reference_dir"),
    ("serve-drafter-missing", "06_serve_test.py", lambda tmp: [f"serve.drafter={tmp / 'nowhere'}"], "serve.drafter"),
    ("serve-baseline-missing", "06_serve_test.py", lambda tmp: [f"serve.baseline={tmp / 'nowhere'}"], "serve.baseline"),
]


@pytest.mark.parametrize(("name", "script", "overrides", "expected"), CASES, ids=[c[0] for c in CASES])
def test_force_refuses_before_it_deletes_and_the_dry_run_refuses_alike(run, tmp_path, capsys, name, script, overrides,
                                                                       expected):
    config, run_dir = run
    folder = run_dir / script.removesuffix(".py")
    before = folder_bytes(folder)
    sets = [a for s in overrides(tmp_path) for a in ("--set", s)]
    for mode in ("--force", "--dry-run"):
        code, out, err = run_stage_in_process(script, config, capsys, mode, *sets)
        lines = without_log_records(err)
        assert code == 2, (mode, out[-2000:], err[-2000:])
        assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], (mode, lines)
        assert folder_bytes(folder) == before, f"{mode} changed {folder}"
    assert json.loads((folder / "manifest.json").read_text())["status"] == "complete"
