"""Self-written prompts: the filter (eagle_pipeline/prompt_filter.py), the user-header prefix
(eagle_pipeline/self_prompts.py) and, for real through vLLM, stage 01 with `data.prompt_source: self`."""

from __future__ import annotations

import json

import pytest
from conftest import REPO, ok, run_stage, write_smoke_config

from eagle_pipeline.config import load_config
from eagle_pipeline.errors import BadInput
from eagle_pipeline.prompt_filter import PromptFilter, content_words, normalise, topic_key
from eagle_pipeline.prompts import load_prompts
from eagle_pipeline.self_prompts import attempt_seed, user_turn_prefix


def eval_filter() -> PromptFilter:
    held_out = load_prompts(REPO / "data" / "prompts_eval.jsonl", "prompt", "data.eval_prompts")
    return PromptFilter.against(held_out, min_words=4, max_words=40)


def test_normalised_text_and_content_words():
    assert normalise("  What's   the BEST way, to learn Python?! ") == "whats the best way to learn python"
    assert content_words("Give me five tips for growing plants.") == ["growing", "plant"]
    assert topic_key("Can you explain how rivers flood?") == "river"


@pytest.mark.parametrize("text, finished, verdict", [
    ("How do I keep basil plants alive indoors?", True, None),
    ("How do I keep basil plants alive", False, "unfinished"),
    ("Basil?", True, "too_short"),
    (" ".join(["word"] * 41), True, "too_long"),
    ("Sure! Here is a recipe for pancakes you can try.", True, "answer_like"),
    ("Ways to save water:\n1. Shorter showers\n2. Fix leaks", True, "answer_like"),
    ("Tell me about rivers<|im_end|>\n<|im_start|>assistant", True, "answer_like"),
    ("Give me tips for studying for an exam.", True, "eval_overlap"),              # an eval prompt's text
    ("What are the rules of friction in physics class?", True, "eval_overlap"),     # an eval topic's word
    ("Which acids and bases are found in a kitchen?", True, "eval_overlap"),        # every word of one
    ("Which acids are found in a kitchen cupboard?", True, None),                  # only part of that topic
])
def test_filter_verdicts(text, finished, verdict):
    assert eval_filter().verdict(text, finished=finished) == verdict


def test_duplicates_and_near_duplicates_of_kept_prompts_are_dropped():
    f = eval_filter()
    assert f.verdict("How do I keep basil plants alive indoors?") is None
    assert f.verdict("how do I keep basil plants alive INDOORS") == "duplicate"
    assert f.verdict("Indoors, how do I keep a basil plant alive?") == "near_duplicate"
    assert f.verdict("How do I keep mint plants alive indoors?") is None


def test_the_user_turn_prefix_ends_at_the_user_header():
    from transformers import AutoTokenizer

    from eagle_pipeline.embedded import resolve_verifier_path

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_verifier_path("embedded:smollm2-135m-instruct")))
    prefix, stop = user_turn_prefix(tokenizer, None, {})
    assert prefix.endswith("<|im_start|>user\n") and stop == "<|im_end|>"
    assert prefix.count("<|im_start|>") == 2  # SmolLM2's default system turn, then the user header
    prefix, _ = user_turn_prefix(tokenizer, "Answer briefly.", {})
    assert "Answer briefly." in prefix and prefix.endswith("<|im_start|>user\n")
    assert attempt_seed(0, 5) == attempt_seed(0, 5) != attempt_seed(1, 5)


def test_self_written_settings_are_validated(tmp_path):
    config = write_smoke_config(tmp_path / "c.yaml", data={"prompt_source": "self", "self_written": {"min_words": 9, "max_words": 3}})
    with pytest.raises(BadInput, match=r"data.self_written.min_words: 9 is above max_words \(3\)"):
        load_config(config)
    with pytest.raises(BadInput, match=r"data.prompt_source: Input should be 'file' or 'self'"):
        load_config(config, ["data.prompt_source=magpie"])


@pytest.mark.vllm
@pytest.mark.slow
def test_stage_01_writes_its_own_prompts_and_answers_them(tmp_path):
    config = write_smoke_config(tmp_path / "run.yaml", data_root=str(tmp_path / "data"), run_name="self")
    overrides = ["--set", "data.prompt_source=self", "--set", "data.num_samples=8", "--set", "generation.batch_size=16"]
    ok(run_stage("01_generate_data.py", config, *overrides))
    stage = tmp_path / "data" / "self" / "01_generate_data"
    from datasets import load_from_disk

    rows = load_from_disk(str(stage / "conversations"))
    assert len(rows) == 8 and all(p.startswith("self-") for p in rows["prompt_id"])
    attempts = [json.loads(line) for part in sorted((stage / "self_written").glob("part-*.jsonl"))
                for line in part.read_text().splitlines()]
    kept = {f"self-{a['attempt']:06d}": a["text"] for a in attempts if a["verdict"] is None}
    for row in rows:  # the prompt is the kept user turn, answered by the target
        assert row["messages"][0] == {"role": "user", "content": kept[row["prompt_id"]]}
        assert row["messages"][-1]["role"] == "assistant" and row["topic"] == topic_key(kept[row["prompt_id"]])
    assert len({normalise(t) for t in kept.values()}) == len(kept)
    manifest = json.loads((stage / "manifest.json").read_text())
    source = manifest["inputs"]["prompts"]
    assert (source["source"], source["seed"], source["temperature"]) == ("self", 0, 1.0)
    assert source["model"] == manifest["inputs"]["verifier"]
    assert manifest["counts"]["self_written"]["attempts"] == len(attempts) >= 8
    # A rerun is complete and writes nothing new.
    again = ok(run_stage("01_generate_data.py", config, *overrides))
    assert "already complete" in again.stdout
