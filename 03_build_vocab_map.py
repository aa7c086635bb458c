"""Stage 03: the draft vocabulary from token frequencies on the assistant tokens of the training data.

The drafter proposes tokens from a smaller vocabulary (32k of Kimi's 163,840) to keep its lm_head cheap;
the most frequent assistant tokens are kept. With `vocab.from_drafter: DIR` the vocabulary of that drafter
(a released one to fine-tune, docs/released_drafters.md) is adopted instead, checked against the target:
its lm_head rows only mean something for the tokens it was trained to propose. Writes `d2t.npy` (int64 offsets) and
`t2d.npy` (bool), the
files speculators' trainer loads (`--d2t-path`, `--t2d-path`) and stage 05 embeds for vLLM.

Embedded default (CPU, seconds):
    python 03_build_vocab_map.py --config configs/tiny.yaml
Full scale:
    python 03_build_vocab_map.py --config configs/kimi-k2.5-10k.yaml

Output in <data_root>/<run_name>/03_build_vocab_map/: d2t.npy, t2d.npy, token_counts.npy, coverage.png,
manifest.json (with the coverage: the share of training tokens the draft vocabulary contains).
"""

import numpy as np

from eagle_pipeline import atomic, plots, released_drafter, vocab
from eagle_pipeline.fingerprint import file_fingerprint
from eagle_pipeline.stage import (
    Stage,
    Start,
    is_complete,
    main,
    not_run_yet_note,
    require_complete,
    require_sample_layout,
    upstream_fingerprint,
)
from eagle_pipeline.verifier import Verifier


def run(stage: Stage, dry_run: bool) -> None:
    cfg = stage.cfg
    draft_vocab_size = cfg.vocab.draft_vocab_size
    planned = dry_run and not is_complete(cfg, 2)  # a dry run before stage 02: from the config and the target
    upstream = None if planned else require_complete(cfg, 2)
    vocab_size = Verifier.from_config(cfg).vocab_size if planned else upstream["counts"]["target_vocab_size"]
    if draft_vocab_size > vocab_size:
        vocab.select_draft_ids(np.zeros(vocab_size, dtype=np.int64), draft_vocab_size)  # raises the BadInput
    adopted = None
    if cfg.vocab.from_drafter and not planned:  # checked before anything is written, dry run included
        _, layout = require_sample_layout(cfg)
        adopted = released_drafter.adopted_vocab_map(cfg.resolve_path(cfg.vocab.from_drafter), "vocab.from_drafter",
                                                     hidden_size=layout.hidden_size, vocab_size=vocab_size,
                                                     draft_vocab_size=draft_vocab_size)
    samples = cfg.data.num_samples if planned else upstream["counts"]["samples"]
    source = f"adopted from {cfg.vocab.from_drafter}" if adopted else f"from {samples} samples"
    if dry_run:
        print(f"stage 03: draft vocabulary of {draft_vocab_size} "
              f"{source}, target vocabulary {vocab_size} -> {stage.dir}")
        if planned:
            print(not_run_yet_note(cfg, 2))
        return

    inputs = {
        "hidden_states": upstream_fingerprint(upstream),
        "draft_vocab_size": draft_vocab_size,
        "target_vocab_size": vocab_size,
    }
    if adopted:  # only then, so that runs counting their own vocabulary keep their recorded inputs
        inputs["from_drafter"] = {"file": str(adopted[2]), "fingerprint": file_fingerprint(adopted[2])}
    if stage.begin(inputs, samples=samples) is Start.ALREADY_COMPLETE:
        print(f"stage 03 already complete for these inputs: {stage.dir}")
        return

    # -- count assistant tokens ---------------------------------------------------------------------
    from datasets import load_from_disk

    data = load_from_disk(str(cfg.stage_dir("02_extract_hidden") / "data")).with_format(None)
    counts = vocab.count_tokens(data["input_ids"], data["loss_mask"], vocab_size)

    # -- select and write ---------------------------------------------------------------------------
    if adopted:
        d2t, t2d = adopted[0].astype(np.int64), adopted[1].astype(bool)
        draft_ids = np.flatnonzero(t2d)
    else:
        draft_ids = vocab.select_draft_ids(counts, draft_vocab_size)
        d2t, t2d = vocab.build_maps(draft_ids, vocab_size)
    for name, array in (("d2t.npy", d2t), ("t2d.npy", t2d), ("token_counts.npy", counts)):
        atomic.write_with(stage.dir / name, lambda tmp, a=array: np.save(open(tmp, "wb"), a))

    covered = vocab.coverage(counts, draft_ids)
    sizes = sorted({s for s in (256, 512, 1024, 2048, 4096, 8192, 16384, 32000, 65536, vocab_size,
                                draft_vocab_size) if s <= vocab_size})
    curve = vocab.coverage_curve(counts, sizes)
    plots.curve(sizes, {"coverage of assistant tokens": curve}, stage.dir / "coverage.png",
                f"draft vocabulary coverage ({covered:.1%} at {draft_vocab_size})", "draft vocabulary size",
                "share of training tokens",
                marks={f"chosen size {draft_vocab_size}": (draft_vocab_size, covered)})
    stats = {
        "samples": samples,
        "assistant_tokens": int(counts.sum()),
        "distinct_tokens_seen": int((counts > 0).sum()),
        "draft_vocab_size": draft_vocab_size,
        "target_vocab_size": vocab_size,
        "coverage": round(covered, 6),
        "coverage_by_size": dict(zip(map(str, sizes), [round(c, 6) for c in curve])),
        "from_drafter": str(cfg.resolve_path(cfg.vocab.from_drafter)) if adopted else None,
    }
    stage.finish(stats, output_fingerprint=file_fingerprint(stage.dir / "d2t.npy"))
    print(f"stage 03 done: {draft_vocab_size} draft tokens ({source}) cover "
          f"{covered:.2%} of {stats['assistant_tokens']} assistant tokens "
          f"({stats['distinct_tokens_seen']} distinct seen) -> {stage.dir}")


if __name__ == "__main__":
    main(3, __doc__, run)
