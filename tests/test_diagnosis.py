"""Stage 06's verdict with a cause, any drafter folder, and proof by sabotage.

Fast tests check the diagnosis rules on given figures and vLLM's reading of a flat config. The slow ones
train a drafter that the engine should accept at a high rate (it overfits the very answers stage 06
served without speculation in the shared small run), convert it with stage 05's converter, break copies
of the flat folder the ways a drafter gets broken, serve them through `serve.drafter` against the shared
run's no-speculation baseline (`serve.baseline`), and check that stage 06 names each planted fault.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_stage, write_smoke_config

from eagle_pipeline.layer_ids import vllm_read_aux_ids
from eagle_pipeline.predict import diagnose as dx

# ---------------------------------------------------------------------------------------------------
# The rules, on given figures.


def _readings(ids=(2, 15, 27), layers=30):
    flags = {"norm_before_residual": True, "norm_before_fc": True, "fc_norm": False, "norm_output": True}
    return dx.readings(ids, layers, flags, has_d2t=True)


def _every_reading(per_position, drafts=200, kl=None):
    """Replay summaries by reading name, every reading with the same figures."""
    return {r.name: _summary(per_position, drafts, kl=kl) for r in _readings()}


def _judge(served, drafts, predictions, findings=()):
    texts = {r.name: r.text for r in _readings()}
    return dx.diagnose(served, drafts, predictions, texts, "as_trained", list(findings))


def _summary(per_position, drafts=200, kl=None):
    return {"predicted_per_position_acceptance": per_position, "num_drafts": drafts,
            "predicted_mean_acceptance_length": 1 + sum(per_position), "first_draft_kl": kl}


def test_readings_cover_both_conventions_defaults_flags_and_d2t():
    names = [r.name for r in _readings(ids=(3, 15, 27))]
    assert names[0] == "as_trained"
    assert {"ids_minus_one", "ids_plus_one", "ids_default", "d2t_dropped", "norm_before_residual_flipped",
            "norm_before_fc_flipped", "fc_norm_flipped", "norm_output_flipped"} <= set(names)
    # The target's defaults (2, 15, 27) equal the declared ids: no separate reading.
    assert "ids_default" not in [r.name for r in _readings()]
    # ids + 1 reaching the final layer feeds its slot: pre- and post-norm readings both exist; id 0 does not.
    edge = {r.name: r for r in _readings(ids=(1, 15, 29))}
    assert "ids_minus_one" not in edge
    assert edge["ids_plus_one"].layer_ids == (2, 16, 30)
    assert edge["ids_plus_one_final_post_norm"].final_post_norm


def test_capture_ids_and_slots_serve_every_reading():
    readings = _readings()
    ids = dx.capture_ids(readings, 30)
    assert ids == [1, 2, 3, 14, 15, 16, 26, 27, 28]
    assert dx.as_variant(readings[0], ids, 30).aux_slots == (1, 4, 7)
    plus = next(r for r in readings if r.name == "ids_plus_one")
    assert dx.as_variant(plus, ids, 30).aux_slots == (2, 5, 8)
    # Only the layers some reading feeds: the final layer (30, ids + 1 from 29) is the sample's last slot anyway.
    assert dx.capture_ids(_readings(ids=(1, 15, 29)), 30) == [1, 2, 15, 16, 27, 29]


def test_short_served_acceptance_is_explained_by_the_reading_that_reproduces_it():
    predictions = _every_reading([0.2, 0.1, 0.05])
    predictions["as_trained"] = _summary([0.8, 0.7, 0.6])
    predictions["ids_plus_one"] = _summary([0.31, 0.12, 0.02])
    result = _judge([0.3, 0.1, 0.0], 190, predictions)
    assert result["status"] == "config" and not result["passed"]
    assert result["cause"] == "ids_plus_one" and result["reproduced"]
    # The verdict line prints rounded figures.
    assert "0.30/0.10/0.00" in result["line"] and "0.80/0.70/0.60" in result["line"]
    assert "off by one" in result["line"] and "0.31" not in result["line"].split("re-simulated")[0]


def test_served_within_tolerance_agrees_and_a_better_reading_means_a_misdeclared_config():
    predictions = _every_reading([0.1, 0.0, 0.0])
    agrees = _judge([0.12, 0.0, 0.0], 200, predictions)
    assert agrees["status"] == "agrees" and agrees["passed"]
    predictions["norm_before_residual_flipped"] = _summary([0.9, 0.8, 0.7])
    wrong = _judge([0.12, 0.0, 0.0], 200, predictions)
    assert wrong["status"] == "misdeclared" and wrong["cause"] == "norm_before_residual_flipped"


def test_a_misdeclared_config_is_judged_by_fit_not_by_a_lucky_draft():
    """The figures of the overfit drafter with every aux id one too high: as declared it wins a draft that the
    reading it was trained under loses, yet fits the target's distribution 20% worse."""
    predictions = _every_reading([1.0, 0.94, 0.94], 18, kl=0.0321)
    predictions["ids_minus_one"] = _summary([1.0, 0.94, 0.89], 18, kl=0.0255)
    predictions["fc_norm_flipped"] = _summary([0.94, 0.94, 0.94], 18, kl=0.0402)
    result = _judge([1.0, 0.89, 0.84], 18, predictions)
    assert result["status"] == "misdeclared" and result["cause"] == "ids_minus_one", result["line"]
    assert "0.0255 against 0.0321" in result["line"]
    assert dx.layer_convention(predictions, "as_trained")["convention"] == "one_too_high"


def test_an_alternative_within_the_fit_margin_or_without_a_fit_does_not_fail_a_drafter():
    # The embedded default's drafter as trained (2.298) and its best alternative, a flipped norm_before_fc
    # (2.288): 0.4% lower, inside FIT_MARGIN; one more draft accepted by chance is no evidence either.
    predictions = _every_reading([0.34, 0.13, 0.05], 1900, kl=2.36)
    predictions["as_trained"] = _summary([0.34, 0.13, 0.05], 1900, kl=2.298)
    predictions["norm_before_fc_flipped"] = _summary([0.35, 0.13, 0.05], 1900, kl=2.288)
    predictions["d2t_dropped"] = _summary([0.0, 0.0, 0.0], 2800)
    result = _judge([0.34, 0.13, 0.05], 1900, predictions)
    assert result["status"] == "agrees", result["line"]
    # Beyond the margin the same alternative is named.
    predictions["norm_before_fc_flipped"]["first_draft_kl"] = 2.298 * (1 - dx.FIT_MARGIN) - 0.01
    assert _judge([0.34, 0.13, 0.05], 1900, predictions)["cause"] == "norm_before_fc_flipped"
    # A reading without a fit (no d2t) is judged by acceptance.
    predictions["norm_before_fc_flipped"]["first_draft_kl"] = 2.298
    predictions["d2t_dropped"] = _summary([0.6, 0.3, 0.1], 1500)
    assert _judge([0.34, 0.13, 0.05], 1900, predictions)["cause"] == "d2t_dropped"


def test_a_drafter_that_drafts_nothing_is_weak_not_misdeclared():
    """The smoke run's drafter: a later layer fits 3% better, but it accepts nothing under any reading."""
    predictions = _every_reading([0.02, 0.0, 0.0], 1100, kl=6.6)
    predictions["as_trained"] = _summary([0.02, 0.0, 0.0], 1100, kl=6.537)
    predictions["ids_plus_one"] = _summary([0.03, 0.0, 0.0], 1100, kl=6.343)
    result = _judge([0.01, 0.0, 0.0], 1100, predictions)
    assert result["status"] == "agrees", result["line"]
    # The same fit under a reading that drafts is a misdeclaration.
    predictions["ids_plus_one"] = _summary([dx.MIN_FIRST_ACCEPTANCE + 0.01, 0.0, 0.0], 1100, kl=6.343)
    assert _judge([0.01, 0.0, 0.0], 1100, predictions)["cause"] == "ids_plus_one"


def test_a_config_fault_is_named_before_any_replayed_reading():
    """Without its map the replay of a pruned-vocabulary drafter means nothing: the config is the cause."""
    predictions = _every_reading([0.6, 0.3, 0.1], kl=3.4)
    predictions["ids_plus_one"]["first_draft_kl"] = 3.2
    fault = {"name": "d2t_missing", "fault": True, "text": "no d2t"}
    result = _judge([0.6, 0.3, 0.1], 200, predictions, [fault])
    assert result["status"] == "config" and result["cause"] == "d2t_missing" and not result["passed"]


# An engine's facts as eagle_pipeline.serve.engine_facts summarizes them (the SM120 trap).
ENGINE = {"summary": "target attention backend FLASHINFER_MLA, drafter attention backend TRITON_ATTN, KV-cache dtype "
                     "fp8 (drafter: the target's), model runner V2, torch.compile VLLM_COMPILE, CUDA graphs FULL"}


def _engine_judge(served, predictions, findings=()):
    texts = {r.name: r.text for r in _readings()}
    return dx.diagnose(served, 300, predictions, texts, "as_trained", list(findings), engine=ENGINE)


def test_short_served_acceptance_that_no_reading_reproduces_names_the_engine():
    predictions = _every_reading([0.75, 0.6, 0.5], kl=0.1)
    predictions["as_trained"] = _summary([0.8, 0.7, 0.6], kl=0.1)
    predictions["ids_plus_one"] = _summary([0.6, 0.4, 0.3], kl=0.2)
    result = _engine_judge([0.3, 0.1, 0.05], predictions)
    assert result["status"] == "engine" and result["cause"] == "engine" and not result["passed"], result["line"]
    line = result["line"]
    assert line.startswith("DIAGNOSIS FAIL: ") and "no reading of the drafter's config reproduces it" in line
    # The suspects of this run and what to try, and no reading named as the cause.
    assert "FLASHINFER_MLA" in line and "KV-cache dtype fp8" in line and "serve.engine_variants" in line
    assert "the drafter matches ids" not in line and "one layer higher" not in line
    assert result["closest"] == "ids_plus_one" and result["engine"] == ENGINE


def test_an_engine_that_accepts_nothing_is_not_blamed_on_a_reading_that_accepts_nothing_too():
    """The user's SM120 trap: a correct drafter served 0%; without its map the replay accepts nothing too."""
    predictions = _every_reading([0.75, 0.6, 0.5], kl=0.1)
    predictions["d2t_dropped"] = _summary([0.01, 0.0, 0.0])
    result = _engine_judge([0.0, 0.0, 0.0], predictions)
    assert result["status"] == "engine" and "d2t" not in result["cause_text"], result["line"]
    assert result["also_accepting_nothing"] == ["d2t_dropped"] and "served accepts next to nothing" in result["line"]
    # Where the folder really has no map, the config names it.
    fault = {"name": "d2t_missing", "fault": True, "text": "no d2t for a 512-token draft vocabulary"}
    named = _engine_judge([0.0, 0.0, 0.0], predictions, [fault])
    assert named["status"] == "config" and named["cause"] == "d2t_missing"
    # Some acceptance that only the missing map reproduces names the map.
    predictions["d2t_dropped"] = _summary([0.3, 0.1, 0.02])
    assert _engine_judge([0.31, 0.09, 0.02], predictions)["cause"] == "d2t_dropped"


def test_the_engine_probe_names_the_variant_that_serves_as_predicted():
    predictions = _every_reading([0.75, 0.6, 0.5], kl=0.1)
    verdict = _engine_judge([0.0, 0.0, 0.0], predictions)
    rows = [{"index": 1, "variant": {"verifier.model_runner": "v1"}, "text": "verifier.model_runner=v1",
             "served": [0.0, 0.0, 0.0], "agrees": False, "error": None},
            {"index": 2, "variant": {"verifier.attention_backend": "FLASH_ATTN"}, "text": "verifier.attention_backend=FLASH_ATTN",
             "served": None, "agrees": False, "error": "ValueError: not valid"},
            {"index": 3, "variant": {"verifier.attention_backend": "TRITON_MLA"}, "text": "verifier.attention_backend=TRITON_MLA",
             "served": [0.74, 0.6, 0.49], "agrees": True, "error": None}]
    found = dx.with_probe(verdict, rows)
    assert found["status"] == "engine" and not found["passed"] and found["engine_variant"] == rows[2]["variant"]
    assert "engine variant 3 (verifier.attention_backend=TRITON_MLA) serves as predicted (0.74/0.60/0.49)" in found["line"]
    assert "serve.engine_variants (e.g." not in found["line"] and "FLASHINFER_MLA" in found["line"]
    none = dx.with_probe(verdict, rows[:2])
    assert "engine_variant" not in none
    assert "none of the 2 engine variants serves as predicted" in none["line"]
    assert "2 (verifier.attention_backend=FLASH_ATTN): failed to start (ValueError: not valid)" in none["line"]


def test_served_agrees_within_the_tolerance_at_every_position():
    assert dx.served_agrees([0.77, 0.66, 0.55], 200, [0.8, 0.7, 0.6], 190)
    assert not dx.served_agrees([0.3, 0.66, 0.55], 200, [0.8, 0.7, 0.6], 190)
    assert dx.served_agrees([0.9, 0.9, 0.9], 200, [0.8, 0.7, 0.6], 190)  # above predicted is no engine fault


def test_tolerance_grows_with_fewer_drafts_and_has_a_floor():
    assert dx.tolerance([0.0], 100) == [dx.TOLERANCE_FLOOR]
    few, many = dx.tolerance([0.5], 20)[0], dx.tolerance([0.5], 2000)[0]
    assert few > many > dx.TOLERANCE_FLOOR


def test_vllm_reads_top_level_ids_then_eagle_config_and_v2_only_the_top_level():
    both = {"eagle_aux_hidden_state_layer_ids": [3, 16, 28], "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 27]}}
    assert vllm_read_aux_ids(both) == {"v1": [3, 16, 28], "v2": [3, 16, 28]}
    inner = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 27]}}
    assert vllm_read_aux_ids(inner) == {"v1": [2, 15, 27], "v2": None}
    assert vllm_read_aux_ids({}) == {"v1": None, "v2": None}


def test_config_findings_name_missing_d2t_and_ids_only_in_eagle_config():
    inner = {"draft_vocab_size": 512, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [3, 15, 27]}}
    findings = {f["name"]: f for f in dx.config_findings(inner, num_layers=30, target_vocab_size=49152, has_d2t=False)}
    assert findings["d2t_missing"]["fault"]
    # V2 would capture (2, 15, 27) instead of (3, 15, 27): a fault; with the default ids only a note.
    assert findings["ids_only_in_eagle_config"]["fault"]
    inner["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 15, 27]
    note = dx.config_findings(inner, num_layers=30, target_vocab_size=49152, has_d2t=True)
    assert [(f["name"], f["fault"]) for f in note] == [("ids_only_in_eagle_config", False)]


# ---------------------------------------------------------------------------------------------------
# Proof by sabotage: a drafter the engine should accept at a high rate, and broken copies of it.

OVERFIT_COPIES = 8  # each answer repeated, so that a small validation split still leaves all of them in training
DRAFT_VOCAB = 512


def _write_training_data(data_dir: Path, baseline: dict, states: list[torch.Tensor], slots: list[int]) -> list:
    from datasets import Dataset
    from safetensors.torch import save_file

    (data_dir / "hidden_states").mkdir(parents=True)
    rows = {"input_ids": [], "loss_mask": [], "seq_len": []}
    answers = []
    for row in range(len(states) * OVERFIT_COPIES):
        (prompt, answer), hidden = baseline["token_ids"][row % len(states)], states[row % len(states)]
        tokens = torch.tensor(prompt + answer)
        save_file({"hidden_states": hidden[:, slots].to(torch.bfloat16).contiguous(), "token_ids": tokens},
                  str(data_dir / "hidden_states" / f"hs_{row}.safetensors"))
        rows["input_ids"].append(tokens.tolist())
        rows["loss_mask"].append([0] * len(prompt) + [1] * len(answer))
        rows["seq_len"].append(len(tokens))
        answers += answer
    dataset = Dataset.from_dict(rows)
    dataset.set_format("torch")
    dataset.save_to_disk(str(data_dir))
    return answers


def _write_vocab_map(folder: Path, answer_tokens: list[int], vocab: int) -> tuple[Path, Path]:
    counts = np.bincount(np.array(answer_tokens), minlength=vocab)
    ids = np.sort(np.array(sorted(range(vocab), key=lambda t: (-counts[t], t))[:DRAFT_VOCAB]))
    t2d = np.zeros(vocab, dtype=bool)
    t2d[ids] = True
    np.save(folder / "d2t.npy", (ids - np.arange(DRAFT_VOCAB)).astype(np.int64))
    np.save(folder / "t2d.npy", t2d)
    return folder / "d2t.npy", folder / "t2d.npy"


@pytest.fixture(scope="module")
def strong_drafter(finished_small_run, tmp_path_factory):
    """A flat vLLM folder of a drafter that overfits the shared run's served answers: (folder, config, run_dir)."""
    config, run_dir = finished_small_run
    return build_strong_drafter(run_dir, tmp_path_factory.mktemp("strong")), config, run_dir


def build_strong_drafter(run_dir: Path, root: Path) -> Path:
    """Train on the run's kept no-speculation answers (stage 06's baseline) until it overfits; convert it."""
    from eagle_pipeline.config import load_section
    from eagle_pipeline.convert import convert_for_vllm
    from eagle_pipeline.serve.baseline import load_baseline
    from eagle_pipeline.train import runner
    from eagle_pipeline.train.settings import TrainRun

    stage06 = run_dir / "06_serve_test"
    baseline = load_baseline(stage06, {})
    ids = baseline["captured_layer_ids"]
    from safetensors.torch import load_file

    states = [load_file(str(stage06 / "baseline" / f"hs_{i}.safetensors"))["hidden_states"]
              for i in range(len(baseline["token_ids"]))]
    slots = [ids.index(k) for k in (2, 15, 27)] + [len(ids)]
    answers = _write_training_data(root / "data", baseline, states, slots)
    verifier = target_dir(run_dir)
    from transformers import AutoConfig

    d2t, t2d = _write_vocab_map(root, answers, AutoConfig.from_pretrained(verifier).vocab_size)
    settings = load_section("train", dict(total_seq_len=256, lr=3e-3, num_workers=0, keep_last=1, val_ratio=0.1,
                                          dtype="float32", epochs=OVERFIT_EPOCHS,
                                          # the last checkpoint is used: no selection, no replay per epoch
                                          select_by="val_loss", predict_conversations=0), source="test settings")
    run = TrainRun(data_dir=root / "data", d2t_path=d2t, t2d_path=t2d, verifier_dir=verifier, out_dir=root / "04_train",
                   layer_ids=[2, 15, 27], seed=0, storage_dtype="bfloat16", device="cpu")
    summary = runner.train_drafter(settings, run)
    convert_for_vllm(root / "04_train" / summary["last"]["checkpoint"], root / "intact")
    return root / "intact"


# Trained this far the drafter fits the served answers' states closely, so a wrong reading of it costs a
# clear share of first-draft KL (docs/measurements.md, "Which reading the drafter was trained under").
OVERFIT_EPOCHS = 30


def target_dir(run_dir: Path) -> Path:
    """The served target's folder, as the run's trained checkpoint names it."""
    config = next((run_dir / "04_train" / "checkpoints").glob("*/config.json"))
    return Path(json.loads(config.read_text())["speculators_config"]["verifier"]["name_or_path"])


def sabotaged(intact: Path, out: Path, faults: tuple[str, ...]) -> Path:
    """A copy of the flat folder with the planted faults."""
    shutil.copytree(intact, out)
    for fault in faults:
        _plant(out, fault)
    return out


def _plant(out: Path, fault: str) -> None:
    config = json.loads((out / "config.json").read_text())
    if fault == "ids_shifted":
        ids = [k + 1 for k in config["eagle_aux_hidden_state_layer_ids"]]
        config["eagle_aux_hidden_state_layer_ids"] = ids
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
    elif fault == "ids_only_in_eagle_config":
        del config["eagle_aux_hidden_state_layer_ids"]
    elif fault == "norm_flipped":
        config["norm_before_residual"] = not config["norm_before_residual"]
    elif fault == "d2t_removed":
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(out / "model.safetensors"))
        save_file({k: v for k, v in tensors.items() if k not in ("d2t", "t2d")}, str(out / "model.safetensors"))
    else:
        raise ValueError(fault)
    (out / "config.json").write_text(json.dumps(config, indent=2))


def serve_folder(tmp_path: Path, run_dir: Path, drafter: Path, name: str, **overrides):
    config = write_smoke_config(tmp_path / f"{name}.yaml", data_root=str(tmp_path / "data"), run_name=name, **overrides)
    result = run_stage("06_serve_test.py", config, "--set", f"serve.drafter={drafter}",
                       "--set", f"serve.baseline={run_dir / '06_serve_test'}", "--set", "serve.ngram_baseline=false",
                       "--set", "serve.confirm_schedule=false", timeout=900)  # one server: the drafter's
    report_path = tmp_path / "data" / name / "06_serve_test" / "report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else None
    return result, report


def print_table_row(folder: str, result, report: dict) -> None:
    """One row of docs/measurements.md's sabotage table, printed for `pytest -s ... | grep '^sabotage row'`."""
    diagnosis = report["diagnosis"]
    served = "/".join(f"{v:.2f}" for v in report["per_position_acceptance"])
    predicted = "/".join(f"{v:.2f}" for v in report["predicted_per_position_acceptance"])
    found = next((f"{row['index']} ({row['text']})" for row in diagnosis.get("engine_probe") or [] if row["agrees"]), "-")
    print(f"sabotage row | {folder} | {served} | {predicted} | exit {result.returncode}, {diagnosis['status']}, "
          f"{diagnosis['cause']} | {found} |")


@pytest.mark.slow
@pytest.mark.vllm
def test_intact_drafter_served_and_predicted_agree(strong_drafter, tmp_path):
    intact, _, run_dir = strong_drafter
    result, report = serve_folder(tmp_path, run_dir, intact, "intact")
    assert report is not None, result.stdout[-3000:] + result.stderr[-3000:]
    print_table_row("intact", result, report)
    diagnosis = report["diagnosis"]
    # The drafter is strong: the sabotage below has something to destroy.
    assert report["predicted_per_position_acceptance"][0] >= 0.6, diagnosis["line"]
    assert diagnosis["status"] == "agrees", diagnosis["line"]
    assert result.returncode == 0, result.stdout[-3000:]
    assert report["diagnosis"]["layer_convention"]["convention"] == "vllm"
    assert "## Diagnosis" in (tmp_path / "data" / "intact" / "06_serve_test" / "report.md").read_text()


# (planted faults, the cause stage 06 must name and fail the drafter for, the notes it must add)
SABOTAGE = [
    (("ids_shifted",), "ids_minus_one", []),
    (("d2t_removed",), "d2t_missing", []),
    # vLLM reads the flag as written, so served and replay as declared agree; the fit names the flip.
    # Planted beside it, since a note neither fails a drafter nor changes what it serves: the ids only in
    # eagle_config, which the CPU build's V1 model runner reads; V2 would capture the target's defaults,
    # which for these ids (2, 15, 27) are the same layers.
    (("norm_flipped", "ids_only_in_eagle_config"), "norm_before_residual_flipped", ["ids_only_in_eagle_config"]),
]


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("faults, cause, notes", SABOTAGE, ids=["+".join(case[0]) for case in SABOTAGE])
def test_served_sabotage_is_named(strong_drafter, tmp_path, faults, cause, notes):
    intact, _, run_dir = strong_drafter
    name = "+".join(faults)
    broken = sabotaged(intact, tmp_path / name, faults)
    result, report = serve_folder(tmp_path, run_dir, broken, name)
    assert report is not None, result.stdout[-3000:] + result.stderr[-3000:]
    print_table_row(name, result, report)
    diagnosis = report["diagnosis"]
    assert [f["name"] for f in diagnosis["findings"] if not f["fault"]] == notes, diagnosis["line"]
    if notes:
        assert "model runner V2" in diagnosis["line"], diagnosis["line"]
    if faults == ("ids_shifted",):
        # The best fit is at the ids the drafter was trained on, wherever it runs. How far ahead it is depends
        # on how much this drafter, overfit on three short answers, leans on the hidden states rather than
        # the token embedding: one layer off fit 20% worse on an AVX-512 machine and 3% on an AVX-2-only one,
        # whose answers and kernels differ. The drafter fails only where the fit clears the margin.
        assert diagnosis["layer_convention"]["convention"] == "one_too_high", diagnosis["line"]
        named, _ = dx.better_reading(report["prediction_readings"], "as_declared")
        assert named in (None, cause), diagnosis["line"]
        if named is None:
            assert diagnosis["status"] == "agrees" and result.returncode == 0, diagnosis["line"]
            return
    assert result.returncode == 1, result.stdout[-3000:]
    assert diagnosis["cause"] == cause, diagnosis["line"]
    assert "DIAGNOSIS FAIL" in result.stdout


# tests/engine_fault/sitecustomize.py: in every process of a run whose env puts it on PYTHONPATH, vLLM's EAGLE-3
# drafter gets noise instead of the target's states in its fc input, unless the variable says "off".
ENGINE_FAULT = {"PYTHONPATH": str(Path(__file__).parent / "engine_fault"), "EAGLE_TEST_ENGINE_FAULT": "fc_noise"}


# The rule that names the engine, and the probe that finds the variant, are shown on given figures in the suite
# (test_short_served_acceptance_that_no_reading_reproduces_names_the_engine, test_the_engine_probe_names_...).
@pytest.mark.heavy
@pytest.mark.slow
@pytest.mark.vllm
def test_a_fault_in_the_engine_alone_is_named_as_the_engine_and_the_variant_without_it_is_found(strong_drafter, tmp_path):
    """The intact folder, served by an engine that computes its drafter wrongly: no reading of the config is to
    blame, and of the engine variants the one that switches the fault off serves as predicted."""
    intact, _, run_dir = strong_drafter
    variant = {"env": {"EAGLE_TEST_ENGINE_FAULT": "off"}}
    result, report = serve_folder(tmp_path, run_dir, intact, "engine-fault", env=ENGINE_FAULT,
                                  serve={"engine_variants": [variant]})
    assert report is not None, result.stdout[-3000:] + result.stderr[-3000:]
    print_table_row("intact, engine fault planted (fc input noise)", result, report)
    diagnosis = report["diagnosis"]
    assert result.returncode == 1 and "DIAGNOSIS FAIL" in result.stdout, result.stdout[-3000:]
    assert diagnosis["status"] == "engine" and diagnosis["cause"] == "engine", diagnosis["line"]
    # The same folder and replay as the intact test: predicted high, served far below.
    predicted, served = report["predicted_per_position_acceptance"][0], report["per_position_acceptance"][0]
    assert predicted >= 0.6 and predicted - served > 0.3, diagnosis["line"]
    assert "model runner V1" in diagnosis["line"] and "EAGLE_TEST_ENGINE_FAULT=fc_noise" in diagnosis["line"]
    probe = diagnosis["engine_probe"]
    assert len(probe) == 1 and probe[0]["agrees"] and diagnosis["engine_variant"] == variant, diagnosis["line"]
    assert "engine variant 1 (env EAGLE_TEST_ENGINE_FAULT=off) serves as predicted" in diagnosis["line"]
    markdown = (tmp_path / "data" / "engine-fault" / "06_serve_test" / "report.md").read_text()
    assert "| 1 | env EAGLE_TEST_ENGINE_FAULT=off |" in markdown and "## Worst prompts" in markdown
    # vLLM's per-request acceptance for every eval prompt, beside the replay's.
    assert all(row["served_mean_acceptance_length"] is not None for row in report["per_prompt"])


def test_a_drafter_folder_without_config_is_bad_input_naming_the_key(tmp_path):
    config = write_smoke_config(tmp_path / "run.yaml", data_root=str(tmp_path / "data"), run_name="t")
    (tmp_path / "empty").mkdir()
    result = run_stage("06_serve_test.py", config, "--set", f"serve.drafter={tmp_path / 'empty'}", "--dry-run", timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "serve.drafter" in errors[0] and "config.json" in errors[0], result.stderr


def test_a_flat_folder_replays_exactly_as_the_checkpoint_it_was_converted_from(tmp_path):
    """convert_for_vllm, then back: the same drafts at every step (the target's embedding shared, as in vLLM)."""
    from speculators import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle_pipeline.convert import convert_for_vllm
    from eagle_pipeline.predict.flat_drafter import write_speculators_checkpoint
    from eagle_pipeline.predict.simulate import draft_table
    from eagle_pipeline.predict.speculators_drafter import SpeculatorsDrafter, load_drafter

    torch.manual_seed(0)
    shape = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=512, tie_word_embeddings=False)
    target = LlamaForCausalLM(LlamaConfig(num_hidden_layers=4, **shape))
    target.save_pretrained(tmp_path / "verifier")
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=LlamaConfig(num_hidden_layers=1, **shape), draft_vocab_size=128,
        norm_before_residual=True, norm_before_fc=True, eagle_aux_hidden_state_layer_ids=[1, 2, 3],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=str(tmp_path / "verifier"), architectures=["LlamaForCausalLM"])))
    drafter = Eagle3DraftModel(config)
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.normal_(0, 0.05)
        drafter.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        ids = torch.sort(torch.randperm(512)[:128]).values
        drafter.d2t.copy_(ids - torch.arange(128))
        drafter.t2d.zero_()
        drafter.t2d[ids] = True
    drafter.save_pretrained(tmp_path / "ckpt")
    convert_for_vllm(tmp_path / "ckpt", tmp_path / "flat")
    back = write_speculators_checkpoint(tmp_path / "flat", tmp_path / "verifier", tmp_path / "back", speculative_tokens=3)
    tokens, aux = torch.randint(0, 512, (40,)), torch.randn(40, 3, 64)
    expected = draft_table(SpeculatorsDrafter(load_drafter(tmp_path / "ckpt")), tokens, aux, 3)
    assert torch.equal(draft_table(SpeculatorsDrafter(load_drafter(back)), tokens, aux, 3), expected)
