"""How much disk a run needs, stage by stage: the one owner of the estimates that dry runs print and that
stages check before they write (eagle_pipeline.stage.check_disk).

- stage 02: every token's hidden states (samples.estimate_bytes);
- stage 04: the kept checkpoints (speculators 0.9 saves every weight in bf16 and, for the trained ones only,
  AdamW's two moments in bf16; the frozen target embedding, most of a Kimi drafter, has no optimizer state);
- stage 06: the captured states of the no-speculation answers it keeps as its baseline.
Stage 02, the stage that fills the disk, also reserves what stages 04 and 06 will need after it, so that a
disk filled by hidden states is refused at stage 02 rather than hours later.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eagle_pipeline.samples import SampleLayout, estimate_bytes


@dataclass(frozen=True)
class DraftDims:
    """The drafter's decoder shape: train.draft_shape where given, the verifier's otherwise."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int

    @classmethod
    def for_run(cls, cfg, verifier) -> "DraftDims":
        text = verifier.text_config()
        shape = cfg.train.draft_shape.model_dump(exclude_none=True) if cfg.train.draft_shape else {}
        hidden = shape.get("hidden_size", verifier.hidden_size)
        heads = shape.get("num_attention_heads", text.get("num_attention_heads"))
        return cls(hidden=hidden, heads=heads, kv_heads=shape.get("num_key_value_heads", text.get("num_key_value_heads", heads)),
                   head_dim=shape.get("head_dim", text.get("head_dim") or hidden // heads),
                   intermediate=shape.get("intermediate_size", text.get("intermediate_size")))


def drafter_params(dims: DraftDims, target_hidden: int, n_aux: int, draft_vocab: int, vocab: int) -> int:
    attention = 2 * dims.hidden * (dims.heads + 2 * dims.kv_heads) * dims.head_dim + dims.heads * dims.head_dim * dims.hidden
    return (n_aux * target_hidden * dims.hidden + attention + 3 * dims.hidden * dims.intermediate
            + draft_vocab * dims.hidden + vocab * dims.hidden)


def checkpoint_bytes(params: int, frozen: int, keep: int) -> int:
    """Disk for the kept checkpoints (plus the best)."""
    return (2 * params + 4 * (params - frozen)) * (keep + 1)


def training_bytes(cfg, verifier, layout: SampleLayout) -> int:
    dims = DraftDims.for_run(cfg, verifier)
    params = drafter_params(dims, verifier.hidden_size, len(layout.layer_ids), cfg.vocab.draft_vocab_size, verifier.vocab_size)
    return checkpoint_bytes(params, frozen=verifier.vocab_size * dims.hidden, keep=cfg.train.keep_last)


def baseline_capture_bytes(cfg, layout: SampleLayout) -> int:
    """Stage 06's kept states: every eval prompt at its longest (prompt and answer within the context)."""
    if not cfg.serve.predict:
        return 0
    tokens = cfg.data.num_eval_prompts * cfg.verifier.max_model_len
    return estimate_bytes(tokens, layout.num_hidden_states, layout.hidden_size, layout.storage_dtype)


def later_stages_bytes(cfg, verifier, layout: SampleLayout) -> tuple[int, str]:
    """What stages 04 and 06 will write after stage 02, and a phrase saying so for an error line."""
    checkpoints, baseline = training_bytes(cfg, verifier, layout), baseline_capture_bytes(cfg, layout)
    return checkpoints + baseline, (f"~{checkpoints / 1e9:.1f} GB of stage 04 checkpoints and at most "
                                    f"~{baseline / 1e9:.1f} GB of stage 06 captured states")


def same_disk(a: Path, b: Path) -> bool:
    """Whether two paths (or the nearest folders above them that exist) lie on one file system."""
    def existing(path: Path) -> Path:
        while not path.exists():
            path = path.parent
        return path

    return existing(Path(a)).stat().st_dev == existing(Path(b)).stat().st_dev
