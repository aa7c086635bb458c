"""The target ("verifier") model: where it is, what shape it has, and fingerprints of what shapes data.

Kimi-K2.5 nests its text model under `text_config`; every shape question goes through `text_config()`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from eagle_pipeline.config import RunConfig
from eagle_pipeline.drafter.layouts import FLAT_ARCHITECTURE, SPECULATORS, config_layout
from eagle_pipeline.drafter.tensors import MLA_DIM_KEYS
from eagle_pipeline.embedded import EMBEDDED_PREFIX, gguf_path, not_converted_yet, resolve_verifier_path
from eagle_pipeline.errors import BadInput
from eagle_pipeline.fingerprint import file_fingerprint, model_dir_fingerprint, text_fingerprint
from eagle_pipeline.json_files import read_json_object

# What the pipeline reads of the target's (text) config: layer ids, sample shapes, the derived drafter's decoder.
TEXT_SHAPE_KEYS = ("num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads", "intermediate_size")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "tokenizer_config.json", "vocab.json",
                   "merges.txt")


def target_embedding(verifier_dir: str | Path):
    """The target's input embedding [vocab, H] (float32) from its safetensors weights: the one vLLM shares with a
    drafter folder that has none, so the one a drafter is trained and replayed with."""
    from safetensors import safe_open

    for file in sorted(Path(verifier_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.endswith("embed_tokens.weight"):
                    return f.get_tensor(name).float()
    raise BadInput(f"{verifier_dir}: no embed_tokens.weight in the target's weights; the drafter needs its embedding")


def check_model_dir(path: Path) -> None:
    if not path.is_dir():
        raise BadInput(f"verifier.path: {path} is not a directory; point it at "
                       "an HF model folder or embedded:smollm2-135m-instruct")
    if not (path / "config.json").exists():
        raise BadInput(f"verifier.path: {path} has no config.json, so it is not an HF model folder; point it at one")


def check_verifier_path(cfg: RunConfig) -> None:
    """Validate verifier.path without converting or loading anything (for --dry-run and early checks)."""
    raw = cfg.verifier.path
    if raw.startswith(EMBEDDED_PREFIX):
        gguf_path(raw[len(EMBEDDED_PREFIX):])
    else:
        check_model_dir(cfg.resolve_path(raw))


def _import_fix(error: ImportError) -> str:
    """What to do when a model's remote tokenizer code imports something this transformers lacks."""
    if "bytes_to_unicode" in str(error):
        # Older Kimi-K2 revisions of tokenization_kimi.py: docs/engines.md, "Kimi-K2 and Kimi-K2.5".
        return ("take the model's current tokenization_kimi.py, or change its import to "
                "`from transformers.convert_slow_tokenizer import bytes_to_unicode` (docs/engines.md)")
    return "the model's remote code was written for another transformers version: update the model's code files"


@dataclass
class Verifier:
    path: Path
    trust_remote_code: bool = False

    @classmethod
    def from_config(cls, cfg: RunConfig) -> "Verifier":
        raw = cfg.verifier.path
        path = resolve_verifier_path(raw) if raw.startswith(EMBEDDED_PREFIX) else cfg.resolve_path(raw)
        check_model_dir(path)
        verifier = cls(path=path, trust_remote_code=cfg.verifier.trust_remote_code)
        verifier.raw_config  # noqa: B018 - a damaged or foreign config.json is named before the tokenizer reads it
        return verifier

    @classmethod
    def if_converted(cls, cfg: RunConfig) -> "Verifier | None":
        """from_config, or None for an embedded target not converted yet (converting it is stage 01's first use,
        not a dry run's or a check's)."""
        return None if not_converted_yet(cfg.verifier.path) else cls.from_config(cfg)

    @cached_property
    def raw_config(self) -> dict[str, Any]:
        """The target's config.json, refused (BadInput naming the file) unless it is a target model's config with
        every shape field the pipeline reads: not a drafter's, not torn, not another kind of JSON."""
        path = self.path / "config.json"
        fix = "restore the target model's own config.json, or point verifier.path at the target's HF model folder"
        try:
            config = read_json_object(path, fix, what="model config")
        except BadInput as e:
            raise BadInput(f"verifier.path: {e}") from None
        architectures = config.get("architectures") if isinstance(config.get("architectures"), list) else []
        if config_layout(config) == SPECULATORS or FLAT_ARCHITECTURE in architectures:
            raise BadInput(f"verifier.path: {path} is an EAGLE-3 drafter's config, not a target model's; point "
                           f"verifier.path at the model the drafter is trained for")
        text = config.get("text_config") or config
        where = "text_config." if text is not config else ""
        if not isinstance(text, dict):
            raise BadInput(f"verifier.path: {path}: text_config is a JSON {type(text).__name__}, not an object; {fix}")
        mla = MLA_DIM_KEYS if text.get("kv_lora_rank") is not None else ()  # an MLA target's (q_lora_rank may be null)
        for key in TEXT_SHAPE_KEYS + mla + (("q_lora_rank",) if text.get("q_lora_rank") is not None else ()):
            value, even = text.get(key), key == "qk_rope_head_dim"  # rope rotates pairs of dimensions
            if not isinstance(value, int) or isinstance(value, bool) or value < 1 or (even and value % 2):
                found = "missing" if key not in text else f"{value!r}, not a positive {'even ' * even}integer"
                raise BadInput(f"verifier.path: {path}: {where}{key} is {found}; {fix}")
        return config

    def text_config(self) -> dict[str, Any]:
        """The language model's own config (nested under text_config for Kimi-K2.5 and other VLMs)."""
        return self.raw_config.get("text_config") or self.raw_config

    @property
    def num_layers(self) -> int:
        return int(self.text_config()["num_hidden_layers"])

    @property
    def hidden_size(self) -> int:
        return int(self.text_config()["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.text_config()["vocab_size"])

    @property
    def architecture(self) -> str:
        return (self.raw_config.get("architectures") or ["?"])[0]

    @cached_property
    def tokenizer(self):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(self.path, trust_remote_code=self.trust_remote_code)
        except ImportError as e:
            raise BadInput(f"verifier.path: the tokenizer code in {self.path} "
                           f"fails to import ({e}); {_import_fix(e)}") from None
        except Exception as e:  # noqa: BLE001 - transformers raises many kinds here
            raise BadInput(f"verifier.path: cannot load a tokenizer from {self.path} "
                           f"({type(e).__name__}: {e}); check the folder") from None

    def chat_template(self) -> str:
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise BadInput(f"verifier.path: {self.path} has no chat template; "
                           "add chat_template.jinja or use an instruct model")
        return template if isinstance(template, str) else json.dumps(template, sort_keys=True)

    def fingerprints(self) -> dict[str, str]:
        tokenizer_parts = {name: file_fingerprint(self.path / name) for name in TOKENIZER_FILES
                           if (self.path / name).exists()}
        # A remote-code tokenizer (Kimi-K2.5's tokenization_kimi.py) is part of how text becomes ids.
        tokenizer_parts.update({p.name: file_fingerprint(p) for p in sorted(self.path.glob("tokenization_*.py"))})
        return {
            "verifier": model_dir_fingerprint(self.path),
            "tokenizer": text_fingerprint(json.dumps(tokenizer_parts, sort_keys=True)),
            "chat_template": text_fingerprint(self.chat_template()),
        }
