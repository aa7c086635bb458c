"""Stages 01-03 for real (vLLM CPU) on a few samples: outputs, reruns doing no work, kill and resume."""

import json
import time

import pytest
from conftest import ok, run_stage

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def manifest(folder):
    return json.loads((folder / "manifest.json").read_text())


def test_outputs_are_complete_and_described(small_run):
    _, _, run_dir = small_run
    from datasets import load_from_disk

    conversations = load_from_disk(str(run_dir / "01_generate_data" / "conversations"))
    assert conversations["sample_id"] == [f"s{i:06d}" for i in range(6)]
    assert all(r in ("stop", "length") for r in conversations["finish_reason"])
    assert all(m[-1]["role"] == "assistant" and m[-1]["content"] for m in conversations["messages"])

    m2 = manifest(run_dir / "02_extract_hidden")
    assert m2["status"] == "complete" and m2["inputs"]["layer_ids"] == [2, 15, 27]
    for key in ("verifier", "tokenizer", "chat_template", "conversations"):
        assert key in m2["inputs"]
    assert m2["counts"]["samples"] == 6 and m2["counts"]["capture_tokens_per_s"] > 0

    m3 = manifest(run_dir / "03_build_vocab_map")
    import numpy as np

    d2t = np.load(run_dir / "03_build_vocab_map" / "d2t.npy")
    t2d = np.load(run_dir / "03_build_vocab_map" / "t2d.npy")
    assert d2t.dtype == np.int64 and d2t.shape == (512,)
    assert t2d.dtype == np.bool_ and t2d.shape == (49152,) and t2d.sum() == 512
    assert (np.arange(512) + d2t).tolist() == np.flatnonzero(t2d).tolist()
    assert m3["counts"]["coverage"] == pytest.approx(1.0)  # 6 short answers use fewer than 512 distinct tokens
    assert (run_dir / "03_build_vocab_map" / "coverage.png").stat().st_size > 1000


def test_speculators_data_loader_reads_stage_02_output_unchanged(small_run):
    _, _, run_dir = small_run
    from speculators.train.data import ArrowDataset

    data = ArrowDataset(max_len=2048, datapath=str(run_dir / "02_extract_hidden" / "data"), on_missing="raise")
    assert len(data) == 6
    for i in range(6):
        sample = data[i]
        seq = sample["input_ids"].shape[0]
        assert sample["hidden_states"].shape == (seq, 3 * 576)
        assert sample["verifier_last_hidden_states"].shape == (seq, 576)
        assert sample["loss_mask"].sum() > 0


def test_rerun_of_each_finished_stage_does_no_work(small_run):
    _, config, run_dir = small_run
    for script, folder in (("01_generate_data.py", "01_generate_data"), ("02_extract_hidden.py", "02_extract_hidden"),
                           ("03_build_vocab_map.py", "03_build_vocab_map")):
        before = manifest(run_dir / folder)
        t0 = time.monotonic()
        result = ok(run_stage(script, config))
        assert "already complete" in result.stdout
        assert manifest(run_dir / folder)["finished_at"] == before["finished_at"]
        assert time.monotonic() - t0 < 60, "a finished stage must not start an engine"


def test_changed_layer_ids_make_stage_02_refuse(small_run):
    _, config, _ = small_run
    result = run_stage("02_extract_hidden.py", config, "--set", "hidden_states.layer_ids=[3, 15, 27]")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error:") and "'layer_ids' changed" in result.stderr


def test_the_dtype_the_target_answers_in_is_an_input_of_stage_01(small_run):
    """generation.dtype set to the verifier's own dtype is the same run; another dtype writes other answers, so
    the finished stage refuses it (before any engine starts) instead of mixing them."""
    _, config, _ = small_run
    same = ok(run_stage("01_generate_data.py", config, "--set", "generation.dtype=float32"))
    assert "already complete" in same.stdout
    other = run_stage("01_generate_data.py", config, "--set", "generation.dtype=bfloat16")
    assert other.returncode == 2
    assert other.stderr.strip().splitlines()[-1].startswith("error:") and "input 'engine' changed" in other.stderr


def test_stage_02_trains_on_exactly_the_token_ids_vllm_produced_in_stage_01(small_run):
    _, _, run_dir = small_run
    from datasets import load_from_disk
    from transformers import AutoTokenizer

    conversations = load_from_disk(str(run_dir / "01_generate_data" / "conversations"))
    rows = load_from_disk(str(run_dir / "02_extract_hidden" / "data")).with_format(None)
    tokenizer = AutoTokenizer.from_pretrained(str(_verifier_dir()))
    for conv, row in zip(conversations, rows):
        prompt, completion = conv["prompt_token_ids"], conv["completion_token_ids"]
        assert row["input_ids"] == prompt + completion
        assert row["loss_mask"] == [0] * len(prompt) + [1] * len(completion)
        # The prompt is the chat template's rendering with the generation prompt, as the engine saw it ...
        rendered = tokenizer.apply_chat_template(conv["messages"][:-1], add_generation_prompt=True, tokenize=True, return_dict=False)
        assert prompt == rendered
        # ... and the completion is the answer text followed by the end-of-turn token the target generated.
        assert tokenizer.decode(completion, skip_special_tokens=True) == conv["messages"][-1]["content"]
    stop = [c for c in conversations if c["finish_reason"] == "stop"]
    assert all(c["completion_token_ids"][-1] == tokenizer.convert_tokens_to_ids("<|im_end|>") for c in stop)


def _verifier_dir():
    from eagle_pipeline.embedded import materialize

    return materialize("smollm2-135m-instruct")


def test_stage_01_measures_each_prompt_as_the_engine_renders_it(small_run):
    """The length stage 01 drops prompts by (eagle_pipeline/prompt_fit.py) is the length of the prompt ids vLLM
    rendered for it; the smoke run's prompts all fit, so none is dropped and the list is empty."""
    _, config, run_dir = small_run
    from datasets import load_from_disk
    from transformers import AutoTokenizer

    from eagle_pipeline.prompt_fit import template_counter

    folder = run_dir / "01_generate_data"
    conversations = load_from_disk(str(folder / "conversations"))
    tokenizer = AutoTokenizer.from_pretrained(str(_verifier_dir()))
    counted = template_counter(tokenizer, None, {})([c["messages"][:-1] for c in conversations])
    assert counted == [len(c["prompt_token_ids"]) for c in conversations]
    counts = manifest(folder)["counts"]
    assert counts["dropped_prompts"] == 0 and (folder / "dropped_prompts.jsonl").read_text() == ""
    assert 0 <= counts["truncated_share"] <= 1
    assert counts["truncated_share"] == conversations["finish_reason"].count("length") / len(conversations)
