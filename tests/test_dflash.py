"""DFlash block drafters (train.family: dflash): stage 04 trains one in speculators' own model and Trainer on a tiny
random verifier, each epoch's checkpoint replayed by the block replay (eagle_pipeline/predict/blocks.py)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_training import LAYER_IDS, VOCAB, llama_case, read_rows, settings  # noqa: F401 - llama_case: a fixture

from eagle_pipeline.train import checkpoints, runner

DFLASH = {"family": "dflash", "dflash": {"block_size": 4, "num_layers": 2, "max_anchors": 32}}
MASK = VOCAB - 1


@pytest.fixture(scope="module")
def dflash_trained(llama_case, tmp_path_factory) -> dict:  # noqa: F811
    out = tmp_path_factory.mktemp("dflash") / "04_train"
    train = settings(epochs=2, **DFLASH)
    summary = runner.train_drafter(train, llama_case.run(out, mask_token_id=MASK))
    return {"out": out, "summary": summary, "train": train}


def test_stage_04_trains_speculators_dflash_model_with_every_layer_full_attention(dflash_trained, llama_case):  # noqa: F811
    out, summary = dflash_trained["out"], dflash_trained["summary"]
    argv = json.loads((out / "run_stats.json").read_text())["argv"]
    assert argv[argv.index("--speculator-type") + 1] == "dflash"
    assert [argv[argv.index(flag) + 1] for flag in ("--block-size", "--max-anchors", "--mask-token-id")] == [
        "4", "32", str(MASK)]
    assert not {"--ttt-steps", "--norm-before-fc", "--no-norm-before-fc", "--norm-output"} & set(argv)
    config = json.loads((out / summary["last"]["checkpoint"] / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["aux_hidden_state_layer_ids"] == LAYER_IDS
    assert (config["block_size"], config["mask_token_id"], config["draft_vocab_size"]) == (4, MASK, VOCAB // 4)
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["layer_types"] == ["full_attention"] * 2

    # speculators' DFlash metrics in metrics.csv: the block's accuracy, each mask slot's, the expected length.
    rows = read_rows(out)
    assert [int(r["epoch"]) for r in rows if r["split"] == "val"] == [0, 1]
    for key in ("loss", "full_acc", "position_1_acc", "position_3_acc", "eal"):
        assert all(r[key] != "" for r in rows), key
    assert "position_4_acc" not in rows[0] and "cond_acc_0" not in rows[0]
    assert (out / "loss_curves.png").stat().st_size > 10_000

    # The best checkpoint is chosen by the block replay of each epoch on the held-out conversations.
    from eagle_pipeline.predict.blocks import predict_block_acceptance
    from eagle_pipeline.train.predicted_acceptance import validation_conversations

    best = json.loads((out / "best.json").read_text())
    assert best["selected_by"] == "predicted_acceptance"
    conversations = validation_conversations(llama_case.data, out, limit=16)
    replayed = predict_block_acceptance(out / best["checkpoint"], conversations, 3)
    assert best["predicted_acceptance_length"] == pytest.approx(replayed["predicted_mean_acceptance_length"], abs=1e-4)
    validation = json.loads((out / best["checkpoint"] / "validation.json").read_text())
    assert len(validation["predicted_per_position_acceptance"]) == 3 and replayed["num_drafts"] > 0


def test_a_dflash_run_resumes_from_its_last_checkpoint(dflash_trained, llama_case, tmp_path):  # noqa: F811
    import shutil

    out = tmp_path / "04_train"
    shutil.copytree(dflash_trained["out"], out)
    summary = runner.train_drafter(settings(epochs=3, **DFLASH), llama_case.run(out, mask_token_id=MASK))
    assert summary["this_run"]["resumed_from"]["epoch"] == 1 and summary["epochs_completed"] == 3
    assert [int(r["epoch"]) for r in read_rows(out) if r["split"] == "val"] == [0, 1, 2]
    assert 2 in checkpoints.complete_checkpoints(out / "checkpoints")


def test_init_from_a_dflash_checkpoint_of_another_block_or_mask_is_refused(dflash_trained, llama_case, tmp_path):  # noqa: F811
    from eagle_pipeline.errors import BadInput

    source = dflash_trained["out"] / dflash_trained["summary"]["last"]["checkpoint"]
    other = {**DFLASH, "dflash": {**DFLASH["dflash"], "block_size": 8}}
    with pytest.raises(BadInput, match=r"train.init_from: .* has another drafter shape .*block_size 4 vs 8"):
        runner.prepare(settings(init_from=str(source), **other), llama_case.run(tmp_path / "a", mask_token_id=MASK))
    with pytest.raises(BadInput, match=r"mask_token_id 511 vs 7"):
        runner.prepare(settings(init_from=str(source), **DFLASH), llama_case.run(tmp_path / "b", mask_token_id=7))
    with pytest.raises(BadInput, match=r"is not a speculators eagle3 config \(speculators_model_type='dflash'\)"):
        runner.prepare(settings(init_from=str(source)), llama_case.run(tmp_path / "c"))
    runner.prepare(settings(init_from=str(source), **DFLASH), llama_case.run(tmp_path / "d", mask_token_id=MASK))


@pytest.fixture(scope="module")
def replay_case(dflash_trained, llama_case):  # noqa: F811
    from eagle_pipeline.predict.blocks import load_block_drafter
    from eagle_pipeline.train.predicted_acceptance import validation_conversations

    model = load_block_drafter(dflash_trained["out"] / dflash_trained["summary"]["last"]["checkpoint"])
    token_ids, states, prompt_len = validation_conversations(llama_case.data, dflash_trained["out"], limit=1)[0]
    return model, torch.as_tensor(token_ids), states[:, :-1], prompt_len


def test_a_block_reads_only_the_targets_states_before_its_anchor_and_chunks_change_nothing(replay_case, monkeypatch):
    from eagle_pipeline.predict import blocks

    model, tokens, aux, prompt_len = replay_case
    n, k = tokens.shape[0], 3
    table = blocks.block_draft_table(model, tokens, aux, k, prompt_len)
    drafted = list(range(prompt_len - 1, n - k - 1))  # the rows walk_chains reads: anchors prompt_len..n-k-1
    assert (table[drafted] >= 0).all() and (table[: prompt_len - 1] == -1).all() and (table[n - k - 1:] == -1).all()
    assert set(table[drafted].flatten().tolist()) <= set(range(VOCAB))
    # vLLM's context rule: the block anchored at x_p attends to the states of rows < p, and to no token after x_p.
    p = prompt_len + 5
    changed_aux, changed_tokens = aux.clone(), tokens.clone()
    changed_aux[p:] += 1.0
    changed_tokens[p + 1:] = (changed_tokens[p + 1:] + 1) % VOCAB
    other = blocks.block_draft_table(model, changed_tokens, changed_aux, k, prompt_len)
    assert torch.equal(other[: p], table[: p]) and not torch.equal(other[p:], table[p:])
    monkeypatch.setattr(blocks, "ANCHORS_PER_PASS", 3)  # one pass of every anchor, or several: the same drafts
    assert torch.equal(blocks.block_draft_table(model, tokens, aux, k, prompt_len), table)


def test_the_replay_readings_change_the_drafts_and_leave_the_model_as_trained(replay_case):
    from eagle_pipeline.predict.blocks import block_draft_table

    model, tokens, aux, prompt_len = replay_case
    table = block_draft_table(model, tokens, aux, 3, prompt_len)
    # Served causally inside the block, or with another mask token, the drafter computes other drafts.
    assert not torch.equal(block_draft_table(model, tokens, aux, 3, prompt_len, mask_token_id=0), table)
    causal = block_draft_table(model, tokens, aux, 3, prompt_len, causal=True)
    assert not torch.equal(causal, table)
    assert model.config.mask_token_id == MASK and model.block_size == 4 and model.uses_full_attn
    assert torch.equal(block_draft_table(model, tokens, aux, 3, prompt_len), table)


def test_the_plan_counts_the_dflash_drafter_stage_04_writes(dflash_trained, llama_case):  # noqa: F811
    from types import SimpleNamespace

    from safetensors import safe_open

    from eagle_pipeline.drafter.planned import drafter_params, planned_draft_dims

    text = json.loads((llama_case.verifier / "config.json").read_text())
    verifier = SimpleNamespace(text_config=lambda: text, hidden_size=text["hidden_size"], vocab_size=VOCAB)
    cfg = SimpleNamespace(train=dflash_trained["train"], vocab=SimpleNamespace(draft_vocab_size=VOCAB // 4))
    planned = planned_draft_dims(cfg, verifier, len(LAYER_IDS))
    assert (planned.num_layers, planned.hidden_size, planned.draft_vocab_size) == (2, text["hidden_size"], VOCAB // 4)
    checkpoint = dflash_trained["out"] / dflash_trained["summary"]["last"]["checkpoint"]
    with safe_open(str(checkpoint / "model.safetensors"), "pt") as f:
        saved = {name: math.prod(f.get_slice(name).get_shape()) for name in f.keys() if name not in ("d2t", "t2d")}
    norms = sum(size for name, size in saved.items() if "norm" in name)
    # The checkpoint leaves the embedding to the verifier; the plan counts it (the trainer holds it), norms aside.
    assert drafter_params(planned) == sum(saved.values()) - norms + VOCAB * text["hidden_size"]


def test_stage_05s_folder_is_the_checkpoint_read_as_trained_and_its_shapes_are_speculators(dflash_trained, tmp_path):
    from safetensors.torch import load_file, save_file

    from eagle_pipeline import convert
    from eagle_pipeline.drafter_checks import dflash
    from eagle_pipeline.errors import BadInput

    checkpoint = dflash_trained["out"] / dflash_trained["summary"]["last"]["checkpoint"]
    summary = convert.write_dflash_folder(checkpoint, tmp_path / "vllm", LAYER_IDS)
    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    # speculators trains full-attention layers bidirectional inside the block; vLLM 0.32 reads a speculators folder
    # as causal there unless the config says otherwise.
    assert json.loads((checkpoint / "config.json").read_text())["sliding_window_non_causal"] is False
    assert config["sliding_window_non_causal"] is True and summary["sliding_window_non_causal"] is True
    saved, written = load_file(str(checkpoint / "model.safetensors")), load_file(str(tmp_path / "vllm" /
                                                                                    "model.safetensors"))
    assert saved.keys() == written.keys() and all(torch.equal(saved[k], written[k]) for k in saved)
    assert dflash.check_shapes(tmp_path / "vllm")["ok"]
    with pytest.raises(BadInput, match=r"aux_hidden_state_layer_ids \[1, 2, 3\] differ from the \[2, 3, 4\]"):
        convert.dflash_config(checkpoint, [2, 3, 4])

    # A tensor of the wrong shape, one missing and one speculators' model has no place for, each named.
    name = "layers.0.self_attn.k_norm.weight"
    broken = {**{k: v for k, v in written.items() if k != "fc.weight"}, name: written[name][:-1],
              "layers.7.mlp.up_proj.weight": written["layers.0.mlp.up_proj.weight"].clone()}
    save_file(broken, str(tmp_path / "vllm" / "model.safetensors"))
    problems = dflash.check_shapes(tmp_path / "vllm")["detail"]["problems"]
    assert problems == ["fc.weight: missing", "layers.7.mlp.up_proj.weight: no tensor of speculators' DFlashDraftModel "
                        "for this config", f"{name}: shape [{written[name].shape[0] - 1}], the config implies "
                        f"[{written[name].shape[0]}]"]


def test_the_logit_check_names_a_layer_id_offset_a_wrong_mask_token_and_causal_attention():
    from eagle_pipeline.drafter_checks.dflash import readings

    trained = {"aux_hidden_state_layer_ids": [2, 15, 27], "mask_token_id": 3, "sliding_window_non_causal": False,
               "transformer_layer_config": {"layer_types": ["full_attention"]}}
    faithful = {"aux_layer_ids": {"model_runner_v1": [2, 15, 27]}, "mask_token_id": 3, "causal": False}
    assert readings(faithful, trained) == []
    problems = readings({"aux_layer_ids": {"model_runner_v1": [3, 16, 28], "model_runner_v2": None},
                         "mask_token_id": 2, "causal": True}, trained)
    starts = ("vLLM's model_runner_v1 taps the target's layers [3, 16, 28]", "vLLM fills the block with mask token 2",
              "vLLM attends causally inside the block")
    assert len(problems) == 3 and all(p.startswith(start) for p, start in zip(problems, starts)), problems
    assert "a layer-id offset of +1" in problems[0] and "a wrong mask token" in problems[1]
    # speculators' default layers (sliding window, causal in the block) are served causally as trained.
    sliding = {**trained, "transformer_layer_config": {"layer_types": ["sliding_attention"]}}
    assert readings({**faithful, "causal": True}, sliding) == []


@pytest.mark.parametrize("layer_types, non_causal, trained, folder_says", [
    (None, False, False, True),  # no layer_types: speculators' full attention, both ways
    (["full_attention"] * 2, False, False, True),
    (["sliding_attention"] * 2, False, True, False),
    (["sliding_attention"] * 2, True, False, True),
    (["sliding_attention", "full_attention"], False, None, False),  # no folder serves it as trained
])
def test_stage_05_and_both_checks_read_dflash_attention_with_one_rule(layer_types, non_causal, trained, folder_says,
                                                                       tmp_path):
    """Which layers speculators trained causal inside the block, and what stage 05's folder tells vLLM, which
    attends alike in every layer: the folder, the config diagnosis and the logit check agree on every shape."""
    from eagle_pipeline import convert
    from eagle_pipeline.drafter.layouts import dflash_served_causal, dflash_trained_causal
    from eagle_pipeline.drafter_checks.dflash import readings
    from eagle_pipeline.predict.diagnose import config_findings

    layers = {"num_hidden_layers": 1} if layer_types is None else {"layer_types": layer_types}
    config = {"speculators_model_type": "dflash", "aux_hidden_state_layer_ids": [2, 15, 27], "mask_token_id": 3,
              "sliding_window_non_causal": non_causal, "transformer_layer_config": layers}
    assert dflash_trained_causal(config) is trained
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").touch()
    folder = convert.dflash_config(tmp_path, [2, 15, 27])
    assert folder["sliding_window_non_causal"] is folder_says and dflash_trained_causal(folder) is trained
    served = dflash_served_causal(folder)
    faithful = trained is not None
    assert (config_findings(folder, num_layers=30, target_vocab_size=8, has_d2t=False) == []) is faithful
    vllm = {"aux_layer_ids": {}, "mask_token_id": 3, "causal": served}
    assert (readings(vllm, config) == []) is faithful
    if not faithful:
        assert "sliding-window layers only: no folder serves it as trained" in config_findings(
            folder, num_layers=30, target_vocab_size=8, has_d2t=False)[0]["text"]
        assert readings(vllm, config) == [
            f"vLLM attends {'causally' if served else 'bidirectionally'} inside the block, the drafter was trained "
            "causally in its sliding-window layers only (vLLM serves a speculators folder causally, every layer "
            "alike, unless sliding_window_non_causal is true)"]


def test_the_config_diagnosis_names_the_sliding_window_non_causal_a_dflash_folder_wants():
    """Full-attention layers trained both ways in a folder served causally; sliding-window layers trained causal
    (speculators' default) in a folder without the key, which vLLM serves both ways."""
    from eagle_pipeline.predict.diagnose import config_findings

    def finding(layer_types: list[str], **key) -> str:
        config = {"speculators_model_type": "dflash", "transformer_layer_config": {"layer_types": layer_types}, **key}
        [found] = config_findings(config, num_layers=30, target_vocab_size=8, has_d2t=False)
        return found["name"] + ": " + found["text"]

    assert finding(["full_attention"], sliding_window_non_causal=False).startswith("causal_flipped: causal attention")
    assert finding(["full_attention"], sliding_window_non_causal=False).endswith("write sliding_window_non_causal true")
    assert finding(["sliding_attention"]).endswith("trained causal; write sliding_window_non_causal false")


@pytest.mark.vllm
def test_stages_03_to_06_train_convert_verify_and_serve_a_dflash_drafter_on_the_smoke_run(finished_small_run,
                                                                                          tmp_path):
    """The shared smoke run's conversations and states; a DFlash drafter of one layer trained for one epoch (one
    step), converted, held by vLLM's own loader and DFlash class to the checkpoint, and served by stage 06 with
    method dflash beside the smoke run's baseline, predicted by the block replay. The same folder served causally
    with another mask token fails the logit check, naming both."""
    import shutil

    from conftest import ok, run_stage, write_smoke_config
    from fault_injection import link_stages

    from eagle_pipeline.config import load_config
    from eagle_pipeline.drafter_checks import verify_drafter
    from eagle_pipeline.train.predicted_acceptance import validation_conversations
    from eagle_pipeline.verifier import Verifier

    _, reference = finished_small_run
    run_dir = tmp_path / "data" / "d"
    link_stages(reference, run_dir, "01_generate_data", "02_extract_hidden")
    config = write_smoke_config(tmp_path / "run.yaml", data_root=str(tmp_path / "data"), run_name="d",
                                train={"family": "dflash", "epochs": 1,
                                       "dflash": {"block_size": 8, "num_layers": 1, "max_anchors": 64}},
                                serve={"num_speculative_tokens": 7})
    for script in ("03_build_vocab_map.py", "04_train.py", "05_convert.py"):
        result = ok(run_stage(script, config))
    verify = json.loads((run_dir / "05_convert" / "verify.json").read_text())
    assert verify["ok"] and not any(check.get("skipped") for check in verify["checks"].values()), result.stdout
    logits = verify["checks"]["vllm_logits"]["detail"]
    assert logits["model_class"] == "DFlashQwen3ForCausalLM" and logits["causal"] is False
    assert logits["mask_token_id"] == 3 and logits["blocks"]["relative_difference"] < 1e-4
    assert verify["checks"]["vllm_load"]["detail"]["model_class"] == "DFlashQwen3ForCausalLM"

    # Stage 06: the drafter alone beside the smoke run's kept answers without speculation, the schedule the smoke
    # config names served by its one confirming server.
    ok(run_stage("06_serve_test.py", config, "--set", f"serve.baseline={reference / '06_serve_test'}",
                 "--set", "serve.ngram_baseline=false", "--set", "serve.num_speculative_tokens_per_batch_size=null"))
    report = json.loads((run_dir / "06_serve_test" / "report.json").read_text())
    served = report["modes"]["dflash"]
    assert served["speculative_config"]["method"] == "dflash", served
    assert report["predicted_mean_acceptance_length"] >= 1.0 and report["verdict"].startswith("PASS"), report["verdict"]
    text = (run_dir / "06_serve_test" / "report.md").read_text()
    assert "## Headline (dflash)" in text and "eagle3" not in text, text

    served = tmp_path / "served"
    shutil.copytree(run_dir / "05_convert" / "vllm", served)
    folder = json.loads((served / "config.json").read_text())
    (served / "config.json").write_text(json.dumps({**folder, "sliding_window_non_causal": False, "mask_token_id": 4}))
    manifest = json.loads((run_dir / "04_train" / "manifest.json").read_text())
    checkpoint = run_dir / "04_train" / manifest["counts"]["best"]["checkpoint"]
    verifier = Verifier.from_config(load_config(config))
    conversations = validation_conversations(run_dir / "02_extract_hidden" / "data", run_dir / "04_train", 1)
    wrong = verify_drafter(served, target_dir=verifier.path, parity_source_dir=checkpoint,
                           parity_conversations=conversations, num_speculative_tokens=7,
                           engine_kwargs={"max_model_len": 1280, "enforce_eager": True})
    problems = wrong["checks"]["vllm_logits"]["detail"]["problems"]
    assert problems[0].startswith("the drafted slots of every block: vLLM's DFlashQwen3ForCausalLM differs"), problems
    assert any("mask token 4" in p for p in problems) and any("attends causally" in p for p in problems)


def test_a_z_lab_dflash_release_is_read_tensor_by_tensor_and_fine_tuned(llama_case, tmp_path):  # noqa: F811
    """A flat release in z-lab's layout (whole vocabulary, z-lab's ids) checked against the run, rewritten by
    speculators' converter with the ids as HF layers, and fine-tuned by stage 04's trainer."""
    import numpy as np
    from released_drafter_standin import write_dflash_release_standin
    from test_training import write_vocab_map

    from eagle_pipeline import released_drafter
    from eagle_pipeline.errors import BadInput

    def read(path, ids=LAYER_IDS, **kwargs):
        return released_drafter.read_dflash_release(path, verifier_dir=llama_case.verifier, layer_ids=ids,
                                                    hidden_size=64, vocab_size=VOCAB, **kwargs)

    release = write_dflash_release_standin(tmp_path / "release", llama_case.verifier, LAYER_IDS, num_layers=2,
                                           block_size=4, mask_token_id=MASK)
    folder, record = read(release)
    assert record == {"convention": "sglang", "written": [0, 1, 2], "hf": LAYER_IDS}
    with pytest.raises(BadInput, match=r"target_layer_ids \[0, 1, 2\] are HF layers \[1, 2, 3\] .*captured \[2, 3, 4\]"):
        read(release, ids=[2, 3, 4])
    with pytest.raises(BadInput, match=r"is not a DFlash release in z-lab's layout"):
        read(release, convention="vllm")
    for name, shape in (("layers.0.self_attn.g_proj.weight", (64, 64)), ("layers.1.self_attn.qkv_proj.weight", (8, 64))):
        broken = write_dflash_release_standin(tmp_path / name, llama_case.verifier, LAYER_IDS, num_layers=2,
                                              block_size=4, mask_token_id=MASK, extra={name: torch.zeros(shape)})
        with pytest.raises(BadInput, match=rf"train.init_from: \S+: {name}: no tensor of speculators' DFlashDraftModel"):
            read(broken)

    written = released_drafter.write_dflash_release(folder, tmp_path / "init_from", verifier_dir=llama_case.verifier,
                                                    layer_ids=LAYER_IDS)
    config = json.loads((tmp_path / "init_from" / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["aux_hidden_state_layer_ids"] == LAYER_IDS
    assert (config["block_size"], config["mask_token_id"], written["dir"]) == (4, MASK, str(tmp_path / "init_from"))
    d2t, t2d = write_vocab_map(tmp_path, np.arange(VOCAB), name="_full")
    train = settings(epochs=1, init_from=str(tmp_path / "init_from"), **DFLASH)
    summary = runner.train_drafter(train, llama_case.run(tmp_path / "04_train", mask_token_id=MASK, d2t_path=d2t,
                                                         t2d_path=t2d))
    assert summary["epochs_completed"] == 1 and summary["best"]["predicted_acceptance_length"] >= 1.0
