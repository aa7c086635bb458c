"""Stage 01's prompts measured with the engine's chat template (eagle_pipeline/prompt_fit.py): which are dropped,
which sample answers which prompt, and what stage 01 writes and refuses. The logic is tested with the embedded
target's real tokenizer; stage 01 itself runs in this process with a stand-in for vLLM's engine, which is all a
test of prompt selection needs (tests/test_stages_01_03.py runs it for real)."""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
from conftest import stage_module, write_config

from eagle_pipeline.config import load_config
from eagle_pipeline.engine import MULTIPROCESSING_VARIABLE
from eagle_pipeline.errors import BadInput
from eagle_pipeline.prompt_fit import (
    NO_ROOM_TO_TRAIN,
    TEMPLATE_REFUSED,
    TOO_LONG_FOR_MODEL,
    LengthLimits,
    Refused,
    check_resumed_samples,
    require_enough,
    select_prompts,
    template_counter,
)
from eagle_pipeline.stage import main


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from eagle_pipeline.embedded import resolve_verifier_path

    return AutoTokenizer.from_pretrained(str(resolve_verifier_path("embedded:smollm2-135m-instruct")))


def prompt(pid: str, text: str) -> dict:
    return {"id": pid, "topic": pid, "messages": [{"role": "user", "content": text}]}


def test_a_prompt_fits_with_room_for_the_least_answer_and_one_token_to_train_on():
    limits = LengthLimits(max_model_len=100, max_seq_len=60, min_answer_tokens=16)
    assert limits.problem(59) is None
    assert limits.problem(60) == NO_ROOM_TO_TRAIN  # stage 02 would keep the prompt alone, no loss token
    limits = LengthLimits(max_model_len=100, max_seq_len=99, min_answer_tokens=16)
    assert limits.problem(84) is None and limits.problem(85) == TOO_LONG_FOR_MODEL


def test_the_least_answer_is_min_answer_tokens_or_max_tokens_if_lower(tmp_path):
    cfg = load_config(write_config(tmp_path / "c.yaml"), ["generation.max_tokens=8", "generation.min_answer_tokens=50"])
    assert LengthLimits.from_config(cfg).min_answer_tokens == 8
    cfg = load_config(write_config(tmp_path / "c.yaml"), ["generation.min_answer_tokens=50"])
    assert LengthLimits.from_config(cfg) == LengthLimits(cfg.verifier.max_model_len, cfg.hidden_states.max_seq_len, 50)


def test_the_count_is_the_engines_prompt_ids(tokenizer):
    """vLLM's LLM.chat renders with the generation prompt and tokenizes without added special tokens: the same
    ids as apply_chat_template(tokenize=True), system prompt and history included."""
    conversations = [
        [{"role": "user", "content": "Name a colour."}],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
         {"role": "user", "content": "Tell me about rivers, and  odd   spacing\u2028too."}],
    ]
    for system in (None, "Answer briefly."):
        counted = template_counter(tokenizer, system, {})(conversations)
        prefix = [{"role": "system", "content": system}] if system else []
        expected = [len(tokenizer.apply_chat_template(prefix + c, add_generation_prompt=True, tokenize=True, return_dict=False))
                    for c in conversations]
        assert counted == expected and expected[1] > expected[0]


def test_a_template_that_refuses_a_conversation_drops_only_it():
    class Strict:
        def apply_chat_template(self, messages, **kwargs):
            if len(messages) > 1:
                raise ValueError("roles must alternate")
            return messages[0]["content"]

        def __call__(self, texts, add_special_tokens):
            return {"input_ids": [t.split() for t in texts]}

    count = template_counter(Strict(), None, {})
    measured = count([[{"role": "user", "content": "a b c"}], [{"role": "user", "content": "x"}] * 2])
    assert measured == [3, Refused("ValueError: roles must alternate")]
    selection = select_prompts([prompt("ok", "a b"), {**prompt("bad", "x"), "messages": [{"role": "user", "content": "x"}] * 2},
                                prompt("ok2", "c")], 2, count, LengthLimits(100, 99, 1))
    assert [p["id"] for p in selection.kept] == ["ok", "ok2"]
    assert selection.dropped == [{"id": "bad", "prompt_tokens": None, "reason": TEMPLATE_REFUSED,
                                  "detail": "ValueError: roles must alternate"}]


def lengths_counter(lengths: dict[str, int], measured: list[str]):
    """A counter that returns each prompt's length from `lengths` (keyed by its text) and records what it measured."""
    def count(batch):
        measured.extend(m[-1]["content"] for m in batch)
        return [lengths[m[-1]["content"]] for m in batch]
    return count


def test_the_next_prompt_that_fits_takes_a_dropped_ones_place_in_file_order():
    prompts = [prompt(f"p{i}", f"t{i}") for i in range(6)]
    lengths = {"t0": 10, "t1": 95, "t2": 10, "t3": 60, "t4": 10, "t5": 10}
    measured: list[str] = []
    selection = select_prompts(prompts, 3, lengths_counter(lengths, measured), LengthLimits(100, 50, 16))
    assert [p["id"] for p in selection.kept] == ["p0", "p2", "p4"]
    assert [(d["id"], d["reason"], d["prompt_tokens"]) for d in selection.dropped] == [
        ("p1", TOO_LONG_FOR_MODEL, 95), ("p3", NO_ROOM_TO_TRAIN, 60)]
    assert selection.measured == 5 and selection.reasons() == {NO_ROOM_TO_TRAIN: 1, TOO_LONG_FOR_MODEL: 1}
    assert measured == [f"t{i}" for i in range(6)]  # one batch, each prompt measured once
    again = select_prompts(prompts, 3, lengths_counter(lengths, []), LengthLimits(100, 50, 16))
    assert again.kept == selection.kept and again.dropped == selection.dropped


def test_measuring_stops_after_the_batch_that_fills_the_sample_count():
    from eagle_pipeline import prompt_fit

    prompts = [prompt(f"p{i}", f"t{i}") for i in range(1000)]
    measured: list[str] = []
    select_prompts(prompts, 3, lengths_counter({f"t{i}": 5 for i in range(1000)}, measured), LengthLimits(100, 50, 1))
    assert len(measured) == prompt_fit.MEASURE_BATCH


def test_too_few_prompts_that_fit_are_refused_saying_how_many_were_short():
    prompts = [prompt("a", "t0"), prompt("b", "t1"), prompt("c", "t2")]
    limits = LengthLimits(100, 50, 16)
    selection = select_prompts(prompts, 3, lengths_counter({"t0": 10, "t1": 99, "t2": 10}, []), limits)
    with pytest.raises(BadInput) as refused:
        require_enough(selection, 3, "prompts.jsonl", limits)
    message = str(refused.value)
    assert message.startswith("data.num_samples: 3 conversations wanted but only 2 of the 3 prompts in prompts.jsonl fit, 1 short")
    assert "the first id 'b' with 99 tokens" in message and "lower data.num_samples to 2" in message
    require_enough(selection, 2, "prompts.jsonl", limits)


def test_a_resumed_sample_must_answer_the_prompt_it_is_tied_to():
    done = {"s000000": {"prompt_id": "a"}, "s000001": {"prompt_id": "c"}}
    check_resumed_samples(done, ["s000000", "s000001", "s000002"], [prompt("a", ""), prompt("c", ""), prompt("d", "")], "parts")
    with pytest.raises(BadInput, match=r"^parts: sample s000001 answered prompt 'c', but the prompts that fit now tie it to 'b'"):
        check_resumed_samples(done, ["s000000", "s000001"], [prompt("a", ""), prompt("b", "")], "parts")


def test_truncation_warning_names_the_limit_and_says_when_thinking_is_cut(tmp_path):
    module = stage_module("01_generate_data.py")
    cfg = load_config(write_config(tmp_path / "c.yaml"), ["generation.max_truncated_share=0.25"])
    assert module.truncation_warning({"stop": 3, "length": 1}, 4, cfg) is None  # exactly the share allowed
    warning = module.truncation_warning({"stop": 2, "length": 2}, 4, cfg)
    assert "2 of 4 answers (50%)" in warning and "generation.max_tokens (256)" in warning and "thinking" not in warning
    thinking = load_config(write_config(tmp_path / "c.yaml"), ["generation.reasoning=true"])
    assert "thinking traces are being cut" in module.truncation_warning({"length": 4}, 4, thinking)


# -- stage 01 with a stand-in engine -------------------------------------------------------------------------


class Engine:
    """Stands in for vLLM: records what it is asked and answers every conversation with `finish_reason`."""

    def __init__(self, finish_reason: str = "stop"):
        self.finish_reason = finish_reason
        self.started = 0
        self.asked: list[str] = []

    def module(self) -> types.ModuleType:
        engine = self

        class LLM:
            def __init__(self, **kwargs):
                engine.started += 1

        vllm = types.ModuleType("vllm")
        vllm.LLM = LLM
        vllm.SamplingParams = lambda **kwargs: SimpleNamespace(**kwargs)
        return vllm

    def answer_in_flight(self, llm, conversations, params, **kwargs):
        for i, conversation in enumerate(conversations):
            self.asked.append(conversation[-1]["content"])
            yield i, SimpleNamespace(prompt_token_ids=[1, 2, 3], outputs=[SimpleNamespace(
                text=f"answer {i}", token_ids=[4, 5], finish_reason=self.finish_reason)])


def run_stage_01(config: Path, engine: Engine, *sets: str) -> int:
    module = stage_module("01_generate_data.py")
    argv = ["--config", str(config), *[a for s in sets for a in ("--set", s)]]
    real_vllm = sys.modules.get("vllm")
    sys.modules["vllm"] = engine.module()  # only this entry: patch.dict would also drop what the stage imports
    try:
        # The stand-in engine has no configuration for vLLM to check (the engine rehearsal) and no kernel scan to
        # patch in this process (engine.offline_engine).
        with mock.patch.dict(os.environ), mock.patch.object(module, "answer_in_flight", engine.answer_in_flight), \
                mock.patch.object(module, "before_first_load"), \
                mock.patch("eagle_pipeline.engine.in_process_engine", return_value=False):
            os.environ.pop(MULTIPROCESSING_VARIABLE, None)  # as an earlier in-process engine may have left it
            main(1, module.__doc__, module.run, argv)
    except SystemExit as e:
        return e.code
    finally:
        if real_vllm is None:
            del sys.modules["vllm"]
        else:
            sys.modules["vllm"] = real_vllm
    return 0


TEXTS = {"p0": "Name a colour.", "p1": "Explain " + "the long and winding river " * 300,
         "p2": "Describe " + "a long winding river " * 20, "p3": "Name a fruit.", "p4": "Name a tree.", "p5": "Name a bird."}


@pytest.fixture
def run_config(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": k, "prompt": v}) + "\n" for k, v in TEXTS.items()))
    return write_config(tmp_path / "run.yaml", data_root=str(tmp_path / "data"), run_name="r",
                        data={"prompts": str(prompts), "num_samples": 3}, generation={"batch_size": 2})


def stage_dir(config: Path) -> Path:
    return load_config(config).stage_dir("01_generate_data")


def answered(folder: Path) -> dict[str, str]:
    from datasets import load_from_disk

    rows = load_from_disk(str(folder / "conversations"))
    return dict(zip(rows["sample_id"], rows["prompt_id"]))


def test_stage_01_drops_what_cannot_fit_lists_it_and_answers_the_next_prompts(run_config, capsys):
    engine = Engine()
    assert run_stage_01(run_config, engine) == 0
    folder = stage_dir(run_config)
    assert answered(folder) == {"s000000": "p0", "s000001": "p2", "s000002": "p3"}
    assert TEXTS["p1"] not in engine.asked  # the engine never sees a prompt that cannot fit
    dropped = [json.loads(line) for line in (folder / "dropped_prompts.jsonl").read_text().splitlines()]
    assert [(d["id"], d["reason"]) for d in dropped] == [("p1", TOO_LONG_FOR_MODEL)] and dropped[0]["prompt_tokens"] > 1264
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["counts"]["dropped_prompts"] == 1 and manifest["counts"]["dropped_by_reason"] == {TOO_LONG_FOR_MODEL: 1}
    assert "dropped_prompts.jsonl" in {o["path"] for o in manifest["outputs"]} and "warnings" not in manifest
    assert "1 prompts dropped (ids in dropped_prompts.jsonl)" in capsys.readouterr().out

    # A rerun finds it complete; a larger sample count answers only the next prompt that fits.
    assert run_stage_01(run_config, engine) == 0 and engine.started == 1
    assert run_stage_01(run_config, engine, "data.num_samples=4") == 0
    assert answered(folder) == {"s000000": "p0", "s000001": "p2", "s000002": "p3", "s000003": "p4"}
    assert engine.asked[3:] == [TEXTS["p4"]]


def test_stage_01_refuses_to_resume_samples_that_other_limits_tie_to_other_prompts(run_config, tokenizer, capsys):
    assert run_stage_01(run_config, Engine()) == 0
    folder = stage_dir(run_config)
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file() and "logs" not in p.parts}
    # A sequence limit at p2's length drops p2, so s000001 would now answer p3: the finished stage stays as it
    # is, and extending it is refused.
    limit = template_counter(tokenizer, None, {})([[{"role": "user", "content": TEXTS["p2"]}]])[0]
    assert run_stage_01(run_config, Engine(), f"hidden_states.max_seq_len={limit}") == 0
    assert "already complete" in capsys.readouterr().out
    code = run_stage_01(run_config, Engine(), "data.num_samples=4", f"hidden_states.max_seq_len={limit}")
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and error.startswith("error: ") and "sample s000001 answered prompt 'p2'" in error and "--force" in error
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file() and "logs" not in p.parts} == before


@pytest.mark.parametrize("reasoning", [False, True])
def test_stage_01_warns_and_records_when_too_many_answers_hit_the_limit(run_config, reasoning, capsys):
    assert run_stage_01(run_config, Engine("length"), f"generation.reasoning={str(reasoning).lower()}") == 0
    manifest = json.loads((stage_dir(run_config) / "manifest.json").read_text())
    assert manifest["counts"]["truncated_share"] == 1.0
    [warning] = manifest["warnings"]
    assert "3 of 3 answers (100%)" in warning and "generation.max_tokens (256)" in warning
    assert ("thinking traces are being cut" in warning) is reasoning
    assert warning in capsys.readouterr().err


def test_the_count_is_the_engines_prompt_ids_for_a_remote_code_tokenizer(tmp_path):
    """Kimi-K2.5's Python tokenizer (tiktoken, its own template with the thinking switch) counts the same way."""
    from kimi_standin import write_tokenizer
    from transformers import AutoTokenizer

    write_tokenizer(tmp_path)
    kimi = AutoTokenizer.from_pretrained(tmp_path, trust_remote_code=True)
    conversations = [[{"role": "user", "content": "Name a colour."}],
                     [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                      {"role": "user", "content": "Tell me about rivers."}]]
    for kwargs in ({"thinking": False}, {}):
        expected = [len(kimi.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs))
                    for c in conversations]
        assert template_counter(kimi, None, kwargs)(conversations) == expected
