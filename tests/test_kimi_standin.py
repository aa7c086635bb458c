"""The Kimi-K2.5 stand-in's tokenizer and chat template behave like Kimi-K2.5's (no vLLM, seconds).

tests/test_kimi_vllm.py runs stages 01 and 02 on a model folder with these files; this module shows that
what it runs on has Kimi's traps: a remote-code Python-backend tokenizer without character offsets, and a
template that thinks unless `thinking` is passed as false and drops reasoning from history turns.
"""

from __future__ import annotations

import json

import pytest
from kimi_standin import SPECIAL_TOKENS, VOCAB, kimi_k25_config, write_preprocessor_config, write_tokenizer

ASSISTANT_HEADER = "<|im_assistant|>assistant<|im_middle|>"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from transformers import DeepseekV3Config

    folder = tmp_path_factory.mktemp("kimi_standin")
    write_tokenizer(folder)
    write_preprocessor_config(folder)
    text = {**DeepseekV3Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2).to_dict(), "model_type": "kimi_k2"}
    (folder / "config.json").write_text(json.dumps(kimi_k25_config(text)))
    return folder


@pytest.fixture(scope="module")
def tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, trust_remote_code=True)


def test_autotokenizer_loads_the_remote_code_python_backend_class(tokenizer, folder):
    from transformers import PythonBackend, TokenizersBackend

    assert type(tokenizer).__name__ == "TikTokenTokenizer"
    assert type(tokenizer).__module__.endswith("tokenization_kimi")  # the folder's own file, through auto_map
    assert isinstance(tokenizer, PythonBackend) and not isinstance(tokenizer, TokenizersBackend)
    assert not tokenizer.is_fast
    # One id space for tokenizer, config and embedding rows.
    assert len(tokenizer) == tokenizer.vocab_size == VOCAB
    assert json.loads((folder / "config.json").read_text())["text_config"]["vocab_size"] == VOCAB
    assert {name: tokenizer.convert_tokens_to_ids(name) for name in SPECIAL_TOKENS} == SPECIAL_TOKENS


def test_the_tokenizer_gives_no_offset_mapping(tokenizer):
    # What the loss mask once relied on; stage 02 now trains on stage 01's token ids instead.
    encoded = tokenizer("An answer.", return_offsets_mapping=True)
    assert "offset_mapping" not in encoded and encoded["input_ids"]


def test_special_tokens_are_single_ids_on_both_encode_paths(tokenizer):
    text = "<|im_user|>user<|im_middle|>Hi<|im_end|><think></think>"
    expected_specials = [SPECIAL_TOKENS[t] for t in ("<|im_user|>", "<|im_middle|>", "<|im_end|>", "<think>", "</think>")]
    # Kimi's encode goes straight to tiktoken without keyword arguments, through transformers' generic path with them.
    for ids in (tokenizer.encode(text), tokenizer.encode(text, add_special_tokens=False)):
        assert [i for i in ids if i in SPECIAL_TOKENS.values()] == expected_specials
    assert tokenizer.encode(text) == tokenizer.encode(text, add_special_tokens=False)


def test_the_ranks_tokenize_like_the_smollm2_bpe_they_come_from(tokenizer):
    from transformers import AutoTokenizer

    from eagle_pipeline.embedded import resolve_verifier_path

    smollm2 = AutoTokenizer.from_pretrained(resolve_verifier_path("embedded:smollm2-135m-instruct"))
    for text in ("The quick brown fox jumps over the lazy dog.", "def f(x):\n    return x ** 2  # squares", "Ünïcödé — 日本語 😀 1234"):
        assert tokenizer.encode(text) == [i - 17 for i in smollm2.encode(text, add_special_tokens=False)]
    # Every byte has a rank (tiktoken needs that), so no text is out of vocabulary.
    text = "\x04\x06\x14 bytes SmolLM2 never saw"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_without_trust_remote_code_transformers_silently_converts_the_tiktoken_ranks(folder):
    # Why configs/kimi-k2.5.yaml sets verifier.trust_remote_code: transformers 5.19 then builds a fast
    # tokenizer from tiktoken.model with its own split pattern instead of failing, so Kimi's own code
    # (its pat_str) would not run and token ids could differ from the ones vLLM uses with remote code.
    from transformers import AutoTokenizer, TokenizersBackend

    assert isinstance(AutoTokenizer.from_pretrained(folder), TokenizersBackend)


def render(tokenizer, messages, **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)


QUESTION = [{"role": "user", "content": "Why is the sky blue?"}]


def test_the_template_thinks_unless_thinking_is_false(tokenizer):
    assert render(tokenizer, QUESTION).endswith(ASSISTANT_HEADER + "<think>")
    assert render(tokenizer, QUESTION, thinking=True).endswith(ASSISTANT_HEADER + "<think>")
    assert render(tokenizer, QUESTION, thinking=False).endswith(ASSISTANT_HEADER + "<think></think>")
    # The name other templates use is ignored: this is the trap chat_template.py exists for.
    assert render(tokenizer, QUESTION, enable_thinking=False).endswith(ASSISTANT_HEADER + "<think>")


def test_the_template_uses_kimi_role_markers(tokenizer):
    text = render(tokenizer, [{"role": "system", "content": "Be brief."}, *QUESTION])
    assert text == ("<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>Why is the sky blue?<|im_end|>"
                    + ASSISTANT_HEADER + "<think>")
    # Without a system message Kimi's default one is added.
    assert render(tokenizer, QUESTION).startswith("<|im_system|>system<|im_middle|>You are Kimi")


def test_history_turns_lose_their_reasoning_later_turns_keep_it(tokenizer):
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "", "reasoning_content": "R2", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    text = render(tokenizer, messages)
    assert ASSISTANT_HEADER + "A1<|im_end|>" in text and "R1" not in text
    assert ASSISTANT_HEADER + "<think>R2</think><|tool_calls_section_begin|>" in text
    # A final answer makes every earlier turn history.
    text = render(tokenizer, [*messages, {"role": "assistant", "content": "A2", "reasoning_content": "R3"}, {"role": "user", "content": "Q3"}])
    assert "R1" not in text and "R2" not in text and "R3" not in text


def test_the_pipeline_finds_the_thinking_switch(tokenizer):
    from eagle_pipeline.chat_template import chat_template_kwargs, thinking_switch

    assert thinking_switch(tokenizer.chat_template) == "thinking"
    assert chat_template_kwargs(tokenizer.chat_template, reasoning=False) == {"thinking": False}


def test_the_generation_prompt_ends_in_the_think_token_ids(tokenizer):
    header = tokenizer.encode(ASSISTANT_HEADER)
    think, end_think = SPECIAL_TOKENS["<think>"], SPECIAL_TOKENS["</think>"]
    off = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, thinking=False, tokenize=True, return_dict=False)
    on = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert off[-len(header) - 2:] == [*header, think, end_think]
    assert on[-len(header) - 1:] == [*header, think]


def _dry_run_stage_01(folder, tmp_path):
    from conftest import run_stage, write_smoke_config

    config = write_smoke_config(tmp_path / "kimi.yaml", data_root=str(tmp_path / "data"), run_name="k",
                                verifier={"path": str(folder), "trust_remote_code": True})
    return run_stage("01_generate_data.py", config, "--dry-run")


def test_the_dry_run_loads_the_remote_code_tokenizer_and_shows_the_thinking_switch(folder, tmp_path):
    result = _dry_run_stage_01(folder, tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "tokenizer TikTokenTokenizer, chat template arguments {'thinking': False}" in result.stdout
    assert not (tmp_path / "data").exists()


def test_remote_code_importing_bytes_to_unicode_from_gpt2_is_refused_with_the_fix(folder, tmp_path):
    # Older Kimi-K2 revisions of tokenization_kimi.py import it from the GPT-2 module transformers 5 removed.
    import shutil

    old = tmp_path / "kimi_old_revision"
    shutil.copytree(folder, old)
    code = old / "tokenization_kimi.py"
    current = "from transformers.convert_slow_tokenizer import bytes_to_unicode"
    assert current in code.read_text()
    code.write_text(code.read_text().replace(current, "from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode"))
    result = _dry_run_stage_01(old, tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: verifier.path:"), result.stderr
    assert "bytes_to_unicode" in lines[0] and "from transformers.convert_slow_tokenizer import bytes_to_unicode" in lines[0]
    assert not (tmp_path / "data").exists()
