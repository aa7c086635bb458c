"""The tokenizer and chat template of the tiny Kimi-K2.5 stand-in, shaped like the ones Kimi-K2.5 ships.

Kimi-K2.5's tokenizer is remote code: `tokenization_kimi.py` with `TikTokenTokenizer`, a transformers
Python-backend ("slow") tokenizer over tiktoken, its byte-level BPE ranks in `tiktoken.model`, and
`tokenizer_config.json` naming it through `auto_map` (so it loads only with `trust_remote_code`). Slow
tokenizers give no character offsets, and its chat template switches thinking with `thinking` and rewrites
history turns (docs/engines.md, "Kimi-K2 and Kimi-K2.5"). The stand-in has the same parts: the ranks come
from the embedded SmolLM2 tokenizer's byte-level BPE, and SmolLM2's 17 special ids become the reserved
block after the ranks that holds Kimi's special tokens, so the vocabulary stays at 49,152 ids.
"""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

REMOTE_CODE = Path(__file__).resolve().parent / "kimi_remote_code"
VOCAB = 49152
RESERVED = 17  # TikTokenTokenizer.num_reserved_special_tokens
BASE = VOCAB - RESERVED
# Kimi's special tokens in the reserved block, in Kimi's order; unnamed slots become <|reserved_token_N|>.
SPECIAL_TOKENS = {
    "[BOS]": BASE, "[EOS]": BASE + 1, "<|im_end|>": BASE + 2, "<|im_user|>": BASE + 3, "<|im_assistant|>": BASE + 4,
    "<|im_system|>": BASE + 5, "<|im_middle|>": BASE + 6, "<|media_begin|>": BASE + 7, "<|media_content|>": BASE + 8,
    "<|media_end|>": BASE + 9, "<|media_pad|>": BASE + 10, "<think>": BASE + 11, "</think>": BASE + 12,
    "[UNK]": BASE + 15, "[PAD]": BASE + 16,
}
TOKENIZER_FILES = ("tokenization_kimi.py", "tiktoken.model", "tokenizer_config.json", "chat_template.jinja")


def _byte_decoder() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


def smollm2_ranks() -> dict[bytes, int]:
    """tiktoken ranks from the embedded SmolLM2 tokenizer's byte-level BPE, in its own merge order.

    SmolLM2's ids 17.. are its BPE tokens in merge order (each merge's result has a higher id than its
    parts), which is the priority tiktoken gives a rank, so rank = id - 17. tiktoken needs every single
    byte as a rank and SmolLM2 lacks 21 (control bytes and bytes UTF-8 never or rarely uses); they take
    the ranks of the last merged tokens that no other merge is built from, so no other token changes.
    """
    from eagle_pipeline.embedded import resolve_verifier_path

    source = json.loads((resolve_verifier_path("embedded:smollm2-135m-instruct") / "tokenizer.json").read_text())
    vocab, merges = source["model"]["vocab"], source["model"]["merges"]
    decode = _byte_decoder()
    first = min(vocab.values()) + len(source["added_tokens"])
    by_id = {i: bytes(decode[c] for c in token) for token, i in vocab.items() if i >= first}
    assert len(by_id) == BASE and len(set(by_id.values())) == BASE
    parts = set()
    for merge in merges:
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        parts.update((vocab[left], vocab[right]))
    missing = sorted(set(range(256)) - {b[0] for b in by_id.values() if len(b) == 1})
    leaves = [i for i in sorted(by_id, reverse=True) if i not in parts and len(by_id[i]) > 1][: len(missing)]
    for i, byte in zip(leaves, missing):
        by_id[i] = bytes([byte])
    return {token: i - first for i, token in by_id.items()}


def write_tiktoken_model(path: Path, ranks: dict[bytes, int]) -> None:
    # tiktoken's file format: one "base64(token) rank" per line.
    path.write_text("".join(f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in sorted(ranks.items(), key=lambda kv: kv[1])))


def tokenizer_config() -> dict:
    token = lambda content: {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    return {
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "tokenizer_class": "TikTokenTokenizer",
        "bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "pad_token": "[PAD]",
        "additional_special_tokens": [name for name in SPECIAL_TOKENS if not name.startswith("[")],
        "added_tokens_decoder": {str(i): token(name) for name, i in SPECIAL_TOKENS.items()},
        "clean_up_tokenization_spaces": False,
        "model_max_length": 262144,
    }


def write_tokenizer(folder: Path) -> None:
    """Kimi-K2.5's tokenizer files in `folder`: remote code, tiktoken ranks, tokenizer config, chat template."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(REMOTE_CODE / "tokenization_kimi.py", folder / "tokenization_kimi.py")
    shutil.copy(REMOTE_CODE / "chat_template.jinja", folder / "chat_template.jinja")
    write_tiktoken_model(folder / "tiktoken.model", smollm2_ranks())
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=1))


# Kimi-K2.5's preprocessor_config.json, which vLLM's Kimi-K2.5 processor reads even for text-only use.
MEDIA_PROC_CFG = {
    "patch_size": 14, "merge_kernel_size": 2, "in_patch_limit": 16384, "patch_limit_on_one_side": 512,
    "fixed_output_tokens": None, "in_patch_limit_each_frame": 4096, "in_patch_limit_video": None,
    "max_num_frames_each_video": None, "sample_fps": 2.0, "temporal_merge_kernel_size": 4,
    "timestamp_mode": "hh:mm:ss.fff", "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
}


def write_preprocessor_config(folder: Path) -> None:
    (folder / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": MEDIA_PROC_CFG}))


def kimi_k25_config(text_config: dict) -> dict:
    """Kimi-K2.5's config.json around a DeepSeek-V3 text config (vocab_size = the tokenizer's VOCAB)."""
    assert text_config["vocab_size"] == VOCAB
    return {
        "model_type": "kimi_k25",
        "architectures": ["KimiK25ForConditionalGeneration"],
        "text_config": text_config,
        "vision_config": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64},
        # Kimi-K2.5's config.json carries it; vLLM's EAGLE-3 proposer reads the media token from the target
        # (and vLLM's Kimi-K2.5 processor checks it against the tokenizer's <|media_pad|>).
        "media_placeholder_token_id": SPECIAL_TOKENS["<|media_pad|>"],
        "tie_word_embeddings": False,
    }
