"""How much disk a run needs, stage by stage: the one owner of the figures that dry runs print, that the budget
check (eagle_pipeline.plan.preconditions, `disk_budget_gb`) holds the run to, and that stages check against the free
space before they write (eagle_pipeline.stage.check_disk).

- stage 01: the conversations (token ids and text, CONVERSATION_BYTES_PER_TOKEN);
- stage 02: every token's hidden states (samples.estimate_bytes); none in online mode, and with
  hidden_states.one_pass stage 01 writes them (every conversation's whole) and stage 02 links its files to them;
- stage 03: the vocabulary map (d2t int64, t2d bool; in every drafter file too);
- stage 04: the checkpoints on disk at once (`kept_checkpoints`, each `DrafterSize.checkpoint`; the embedding and the
  draft lm_head are the target's, frozen, with no optimizer moments), a flat `train.init_from` rewritten in
  speculators' layout, and online the states in flight and the kept validation rows;
- stage 05: the flat vLLM folder, and the SGLang folder with `convert.sglang`;
- stage 06: the replay's captured states of the no-speculation answers (kept as its baseline): every layer any
  reading of the drafter needs (eagle_pipeline.predict.diagnose.capture_ids), not only the trained ones.

Hidden states are counted from stage 01's token counts once it has run. Before, each sample is planned at
EXPECTED_SHARE of the longest conversation the config lets stage 01 write (its user turn and its answer at their
token limits, cut at hidden_states.max_seq_len): answers end on their own before generation.max_tokens.
Stage 02, the stage that fills the disk, also reserves what stages 03-06 will need after it, so that a disk
filled by hidden states is refused at stage 02 rather than hours later.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from eagle_pipeline.atomic import nearest_existing
from eagle_pipeline.capture import ENGINE_DTYPE_BYTES
from eagle_pipeline.config import STAGES
from eagle_pipeline.drafter.folder import is_speculators_drafter, read_flat_config
from eagle_pipeline.drafter.layouts import DFLASH
from eagle_pipeline.drafter.planned import drafter_params, planned_draft_dims
from eagle_pipeline.errors import BadInput
from eagle_pipeline.layer_ids import default_layer_ids, vllm_read_aux_ids
from eagle_pipeline.online.disk import sample_bytes, window_bound
from eagle_pipeline.online.kept import keep_count
from eagle_pipeline.outputs import read_manifest
from eagle_pipeline.samples import SampleLayout, estimate_bytes, planned_sample_layout
from eagle_pipeline.verifier import Verifier

GB = 1e9
# The expected length of a training conversation as a share of the longest the config allows, from the runs
# measured: Kimi-K2.5's published 10k-sample run stored ~1.44k tokens a sample (docs/measurements.md; 0.7 of the
# Kimi configs' 2,048 is 1.43k), tiny-quality.yaml 260 of its 352, tiny.yaml's data 168-216 of 256.
EXPECTED_SHARE = 0.7
# Stage 01's conversations dataset: int64 prompt and answer ids and their text.
CONVERSATION_BYTES_PER_TOKEN = 16
# speculators saves checkpoints in bf16 whatever the training dtype (Checkpointer.save_checkpoint's float_dtype).
CHECKPOINT_DTYPE_BYTES = 2


def kept_checkpoints(train) -> int:
    """The most complete checkpoints stage 04's folder holds at once (eagle_pipeline/train/checkpoints.py).

    After each validation keep_checkpoints leaves the newest `keep_last` and the best; the next epoch's save (or
    speculators' `interrupted` save, which takes its place) comes on top before the next pruning. The best lies
    outside the newest `keep_last` only when it may be `keep_last` or more epochs old: always without early
    stopping, and with it only while `keep_last` < `early_stop_patience` (early_stop.stop_due ends training once
    the best is `patience` epochs old: with keep_last 2 and patience 2, three when it fires). Never more than the
    epochs trained.
    """
    patience = train.early_stop_patience
    best_apart = patience is None or train.keep_last < patience
    return min(train.epochs, train.keep_last + 1 + int(best_apart))


@dataclass(frozen=True)
class DrafterSize:
    params: int
    embedding: int
    lm_head: int
    map_bytes: int

    @classmethod
    def for_run(cls, cfg, verifier, n_aux: int) -> "DrafterSize":
        dims = planned_draft_dims(cfg, verifier, n_aux)
        # A DFlash checkpoint leaves the embedding to the verifier.
        embedding = dims.vocab_size * dims.hidden_size * (dims.layer_shape != DFLASH)
        return cls(params=drafter_params(dims) - dims.vocab_size * dims.hidden_size + embedding, embedding=embedding,
                   lm_head=dims.draft_vocab_size * dims.hidden_size,
                   map_bytes=8 * dims.draft_vocab_size + dims.vocab_size)  # d2t int64, t2d bool

    def checkpoint(self, optimizer: str) -> int:
        """One checkpoint: every weight in bf16, and the optimizer's bf16 moments of each trained weight (AdamW two;
        Muon one: speculators' Muon steps every trained matrix, AdamW only the norms, train/optimizers.py)."""
        trainable = self.params - self.embedding - self.lm_head
        return CHECKPOINT_DTYPE_BYTES * (self.params + (1 if optimizer == "muon" else 2) * trainable) + self.map_bytes

    def flat_folder(self) -> int:
        """A converted folder (stage 05): the checkpoint's weights without embed_tokens, and the vocabulary map."""
        return CHECKPOINT_DTYPE_BYTES * (self.params - self.embedding) + self.map_bytes


def _flat_init_from(cfg) -> bool:
    """Whether stage 04 rewrites train.init_from in speculators' layout: a flat folder, or one not readable here."""
    if not cfg.train.init_from:
        return False
    return not is_speculators_drafter(cfg.resolve_path(cfg.train.init_from))


def training_bytes(cfg, verifier, layout: SampleLayout) -> int:
    """What stage 04 writes into its folder whatever the mode: the checkpoints on disk at once, and a flat
    train.init_from in speculators' layout (the target's embedding included)."""
    size = DrafterSize.for_run(cfg, verifier, len(layout.layer_ids))
    init = CHECKPOINT_DTYPE_BYTES * size.params + size.map_bytes if _flat_init_from(cfg) else 0
    return kept_checkpoints(cfg.train) * size.checkpoint(cfg.train.optimizer) + init


def expected_conversation_tokens(cfg) -> int:
    """A training conversation's planned length before stage 01 has counted it (module docstring)."""
    longest = cfg.generation.max_tokens
    if cfg.data.prompt_source == "self":
        longest += cfg.data.self_written.max_tokens
    return math.ceil(EXPECTED_SHARE * longest)


def expected_sample_tokens(cfg) -> int:
    """The same, as stage 02 cuts it at hidden_states.max_seq_len."""
    return min(cfg.hidden_states.max_seq_len, expected_conversation_tokens(cfg))


def reading_layer_ids(layer_ids, num_layers: int) -> list[int]:
    """The aux ids captured once so that every reading of a drafter with these ids can be replayed: the declared
    ones, one layer off either way, the target's defaults. predict.diagnose.capture_ids(readings(...)) says the
    same (tests/test_preconditions.py holds the two equal); importing it takes torch, which a dry run need not."""
    ids = [int(k) for k in layer_ids]
    found = set(ids) | set(default_layer_ids(num_layers))
    for shift in (-1, 1):
        if all(0 < k + shift <= num_layers for k in ids):
            found |= {k + shift for k in ids}
    return sorted(k for k in found if 0 < k < num_layers)


def replay_layer_ids(cfg, layout: SampleLayout) -> list[int]:
    """The aux ids stage 06's replay captures: every reading's (06_serve_test.print_replay_capture_plan)."""
    ids = list(layout.layer_ids)
    if cfg.serve.drafter:  # a drafter from elsewhere: the ids its config declares, where it can be read
        try:
            read = vllm_read_aux_ids(read_flat_config(cfg.resolve_path(cfg.serve.drafter)))
            ids = list(read["v1" if cfg.device == "cpu" else "v2"] or ids)
        except (BadInput, OSError, ValueError, KeyError, TypeError):
            pass
    return reading_layer_ids(ids, layout.num_layers)


def eval_conversation_tokens(cfg) -> int:
    """A no-speculation answer and its prompt, planned at serve.max_tokens each, within verifier.max_model_len."""
    return min(cfg.verifier.max_model_len - 1, 2 * cfg.serve.max_tokens)


def eval_prompt_count(cfg) -> int:
    """The prompts stage 06 serves: data.num_eval_prompts, or the eval file's non-blank lines where it holds fewer
    (read up to that many, at most 1 MiB a line at a time; a file that is no readable regular one counts as full:
    the stages that load it name it)."""
    path, cap, count = cfg.resolve_path(cfg.data.eval_prompts), cfg.data.num_eval_prompts, 0
    try:
        if not path.is_file():  # a pipe or a device would block or never end
            return cap
        with open(path, "rb") as f:
            while count < cap and (line := f.readline(1 << 20)):
                count += bool(line.strip())
    except OSError:
        return cap
    return count


def baseline_capture_bytes(cfg, layout: SampleLayout) -> int:
    """Stage 06's captured states, kept in the engine's dtype (eagle_pipeline/serve/baseline.py)."""
    if not cfg.serve.predict:
        return 0
    states = len(replay_layer_ids(cfg, layout)) + 1  # and the final layer
    tokens = eval_prompt_count(cfg) * eval_conversation_tokens(cfg)
    return tokens * states * layout.hidden_size * ENGINE_DTYPE_BYTES.get(cfg.verifier.dtype, 2)


@dataclass(frozen=True)
class StagePlan:
    number: int
    bytes: int
    what: str  # "hidden states"
    detail: str = ""  # "for 200000 tokens"

    def phrase(self) -> str:
        """For an error line: "stage 02's hidden states (~0.92 GB for 200000 tokens)"."""
        return f"stage {self.number:02d}'s {self.what} (~{amount(self.bytes)}{self._detail()})"

    def _detail(self) -> str:
        return "" if not self.detail else self.detail if self.detail.startswith(",") else " " + self.detail


@dataclass(frozen=True)
class DiskPlan:
    stages: tuple[StagePlan, ...]

    def stage(self, number: int) -> StagePlan:
        return next(s for s in self.stages if s.number == number)

    @property
    def total(self) -> int:
        return sum(s.bytes for s in self.stages)

    def table(self, budget_gb: float | None) -> list[str]:
        """A dry run's block (markdown, as scripts/status.py prints): each stage, then the total against
        disk_budget_gb."""
        if budget_gb is None:
            budget = "no disk_budget_gb set"
        elif self.total > budget_gb * GB:
            budget = f"above disk_budget_gb {budget_gb:g}: raise it to at least {math.ceil(self.total / GB)}"
        else:
            budget = f"within disk_budget_gb {budget_gb:g}"
        return (["| stage | planned disk | what |", "|---|---|---|"]
                + [f"| {STAGES[s.number]} | ~{amount(s.bytes)} | {s.what}{s._detail()} |" for s in self.stages]
                + [f"| total | ~{amount(self.total)} | {budget} |"])


def amount(n: float) -> str:
    if n >= 0.1 * GB:
        return f"{n / GB:.2f} GB"
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} KB"


def planned_tokens(cfg) -> tuple[int, int, str]:
    """(the conversations' tokens, the tokens stage 02 captures of them, how they were counted): stage 01's counts
    once it has finished (stage 02 cuts each sample at hidden_states.max_seq_len, so at most that per sample), else
    data.num_samples x the expected tokens of a conversation."""
    conversations = read_manifest(cfg.stage_dir(STAGES[1]))
    if (conversations or {}).get("status") == "complete":
        counts = conversations.get("counts") or {}
        tokens = int(counts.get("prompt_tokens") or 0) + int(counts.get("completion_tokens") or 0)
        captured = min(tokens, int(counts.get("samples") or 0) * cfg.hidden_states.max_seq_len)
        return tokens, captured, f"{captured} tokens"
    n = cfg.data.num_samples
    return (n * expected_conversation_tokens(cfg), n * expected_sample_tokens(cfg),
            f"{n} samples x ~{expected_sample_tokens(cfg)} tokens expected")


def plan_run(cfg, verifier, layout: SampleLayout) -> DiskPlan:
    """Every stage's planned writes for this config and target."""
    conversation_tokens, tokens, counted = planned_tokens(cfg)
    size = DrafterSize.for_run(cfg, verifier, len(layout.layer_ids))
    online, one_pass = cfg.hidden_states.mode == "online", cfg.hidden_states.one_pass
    states = 0 if online else estimate_bytes(conversation_tokens if one_pass else tokens, layout.num_hidden_states,
                                             layout.hidden_size, layout.storage_dtype)
    training = training_bytes(cfg, verifier, layout)
    detail04 = f", {kept_checkpoints(cfg.train)} on disk at once, ~{amount(size.checkpoint(cfg.train.optimizer))} each"
    if _flat_init_from(cfg):
        detail04 += ", train.init_from in speculators' layout"
    if online:
        longest = cfg.hidden_states.max_seq_len
        training += keep_count(cfg) * sample_bytes(cfg, layout.num_hidden_states, layout.hidden_size, longest)
        detail04 += f", {keep_count(cfg)} kept validation samples"
        if cfg.hidden_states.transfer != "mooncake":  # a local folder holds the states in flight (04_train.py)
            training += window_bound(cfg, layout.num_hidden_states, layout.hidden_size, longest)
            detail04 += ", the states in flight"
    replay = replay_layer_ids(cfg, layout)
    return DiskPlan((
        StagePlan(1, conversation_tokens * CONVERSATION_BYTES_PER_TOKEN + one_pass * states, "conversations",
                  "of token ids and text" + (", and their hidden states (one pass)" if one_pass else "")),
        StagePlan(2, (not one_pass) * states, "hidden states", "(online: none stored)" if online else
                  "(one pass: linked to stage 01's)" if one_pass else f"for {counted}"),
        StagePlan(3, size.map_bytes, "vocabulary map"),
        StagePlan(4, training, "checkpoints", detail04),
        StagePlan(5, (1 + int(cfg.convert.sglang)) * size.flat_folder(), "converted drafter",
                  ", the vLLM and SGLang folders" if cfg.convert.sglang else ", the vLLM folder"),
        StagePlan(6, baseline_capture_bytes(cfg, layout), "captured states",
                  f"of {eval_prompt_count(cfg)} eval conversations x ~{eval_conversation_tokens(cfg)} tokens x "
                  f"{len(replay) + 1} states: layers {replay} and the final one" if cfg.serve.predict
                  else "(serve.predict off)"),
    ))


def plan_for_config(cfg) -> DiskPlan | None:
    """plan_run from the config and the target's config.json; None for an embedded target not yet converted
    (converting it is stage 01's first use, not a dry run's)."""
    verifier = Verifier.if_converted(cfg)
    if verifier is None:
        return None
    layout = planned_sample_layout(cfg, verifier.num_layers, verifier.hidden_size, verifier.vocab_size)
    return plan_run(cfg, verifier, layout)


def later_stages_bytes(cfg, verifier, layout: SampleLayout) -> tuple[int, str]:
    """What stages 03-06 will write after stage 02, and a phrase saying so for an error line."""
    plan = plan_run(cfg, verifier, layout)
    later = [plan.stage(n) for n in (3, 4, 5, 6)]
    return sum(s.bytes for s in later), ", ".join(s.phrase() for s in later if s.bytes)


def same_disk(a: Path, b: Path) -> bool:
    """Whether two paths (or the nearest folders above them that exist) lie on one file system."""
    return nearest_existing(a).stat().st_dev == nearest_existing(b).stat().st_dev


def plan_table(cfg) -> list[str]:
    """The disk block of `scripts/run_pipeline.sh CONFIG --dry-run` (scripts/status.py --plan)."""
    plan = plan_for_config(cfg)
    if plan is None:
        return ["(disk plan: the embedded target's shape is read once stage 01 has converted it)"]
    return plan.table(cfg.disk_budget_gb)
