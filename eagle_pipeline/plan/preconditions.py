"""What every stage checks first, dry run included, before it writes anything: the config against the target
model, the host and the folders it names. What each check refuses, and why: docs/contracts.md, "What is refused
as bad input" (the rows from "the target and the host" to "disk budget").

Stage-specific checks (a drafter's shapes, its layer ids, the vocabulary map) stay with the stage that uses it.
In a dry run what the host lacks (GPUs, the Mooncake software) is said after the plan, as its last line
(`host_shortfall_last`), so that a plan for a GPU host can be read on a laptop.
"""

from __future__ import annotations

import math
import os
import sys
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Iterator

from eagle_pipeline import gpus
from eagle_pipeline.config import STAGES, RunConfig
from eagle_pipeline.drafter.folder import FlatDrafter, read_config
from eagle_pipeline.drafter.layouts import flat_architecture_of
from eagle_pipeline.errors import BadInput
from eagle_pipeline.online.mooncake import mooncake_refusal
from eagle_pipeline.outputs import folder_bytes
from eagle_pipeline.plan.disk import GB, amount, plan_for_config
from eagle_pipeline.released_drafter import check_against_target
from eagle_pipeline.train.draft_config import check_draft_shape
from eagle_pipeline.verifier import Verifier

# (config key, its section and field, the stage that reads the folder)
DRAFTER_FOLDERS = (("vocab.from_drafter", "vocab", "from_drafter", "03_build_vocab_map"),
                   ("train.init_from", "train", "init_from", "04_train"),
                   ("convert.reference_dir", "convert", "reference_dir", "05_convert"),
                   ("serve.drafter", "serve", "drafter", "06_serve_test"))


def check_preconditions(cfg: RunConfig, stage_number: int) -> None:
    """Every check of this module, cheapest first; BadInput names the first problem."""
    check_referenced_folders(cfg)
    check_parallel_split(cfg)
    check_gpu_count(cfg)
    if stage_number == 4:
        check_online_software(cfg)
    check_drafters_against_target(cfg)  # after the GPUs are counted: it may import torch, which would count them
    check_disk_budget(cfg, stage_number)


# -- what the host lacks: in a dry run, said after the plan ---------------------------------------------------

_shortfalls: list[str] | None = None  # collecting, inside host_shortfall_last


@contextmanager
def host_shortfall_last(report: bool = True) -> Iterator[None]:
    """Within it, what this host lacks for the run (GPUs, the Mooncake software) is collected instead of refused,
    so that a dry run prints its whole plan, on a laptop too; on leaving, the first is refused (its `error:` line
    is the dry run's last). `report=False` drops them: scripts/run_pipeline.sh --dry-run checks the host once,
    after every stage's plan (scripts/status.py --plan)."""
    global _shortfalls
    _shortfalls = []
    try:
        yield
        found = list(_shortfalls)
    finally:
        _shortfalls = None
    if found and report:
        raise BadInput(found[0])


def _host_lacks(problem: str) -> None:
    if _shortfalls is None:
        raise BadInput(problem)
    _shortfalls.append(problem)


def check_host(cfg: RunConfig) -> None:
    """Everything this module asks of the host for the whole run: its GPUs and, for stage 04, its software."""
    check_gpu_count(cfg)
    check_online_software(cfg)


def check_online_software(cfg: RunConfig) -> None:
    """Stage 04 of an online run with the Mooncake transfer needs the Mooncake package and programs here."""
    if cfg.hidden_states.mode == "online" and cfg.hidden_states.transfer == "mooncake":
        refusal = mooncake_refusal()
        if refusal:
            _host_lacks(refusal)


# -- folders -----------------------------------------------------------------------------------------------


def check_referenced_folders(cfg: RunConfig) -> None:
    for key, section, name, reader in DRAFTER_FOLDERS:
        value = getattr(getattr(cfg, section), name)
        if value:
            _require_folder(cfg.resolve_path(value), key, reader, "a drafter folder", needs_config=True)
    if cfg.serve.baseline:
        _require_folder(cfg.resolve_path(cfg.serve.baseline), "serve.baseline", "06_serve_test",
                        "a finished run's 06_serve_test folder", needs_config=False)


def _require_folder(path: Path, key: str, reader: str, kind: str, needs_config: bool) -> None:
    fix = f"point it at {kind} (stage {reader} reads it) or leave it unset"
    if not path.exists():
        raise BadInput(f"{key}: {path} does not exist; {fix}")
    if not path.is_dir():
        raise BadInput(f"{key}: {path} is not a folder; {fix}")
    if needs_config and not (path / "config.json").is_file():
        raise BadInput(f"{key}: {path} has no config.json, so it is not a drafter folder; {fix}")


# -- the target's heads ------------------------------------------------------------------------------------


def parallel_split_problem(text_config: dict, tp: int, where: str = "the target") -> str | None:
    """Why vLLM cannot split this language model's attention across `tp` ranks, or None; `where` names the model."""
    heads = text_config.get("num_attention_heads")
    if not isinstance(heads, int) or heads < 1:
        return None  # nothing to check against; vLLM names the config's own problem
    kv_heads = text_config.get("num_key_value_heads") or heads
    if heads % tp:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0 and d <= tp]
        return (f"{tp} does not divide the {heads} attention heads of {where}; choose a divisor of {heads} "
                f"(the largest up to {tp} is {divisors[-1]})")
    # vLLM's QKV layer gives each rank a share of the key/value heads, or replicates them when there are fewer.
    if (tp % kv_heads) if tp >= kv_heads else (kv_heads % tp):
        return (f"{tp} and the {kv_heads} key/value heads of {where} do not divide "
                "one another, which vLLM needs to shard or replicate them; choose a "
                f"tensor parallel size that divides {kv_heads} or is a multiple of it")
    return None


def check_parallel_split(cfg: RunConfig) -> None:
    tp = cfg.verifier.tensor_parallel_size
    if tp == 1:  # one rank holds every head: nothing to read
        return

    verifier = Verifier.from_config(cfg)
    problem = parallel_split_problem(verifier.text_config(), tp, f"the target ({verifier.path / 'config.json'})")
    if problem:
        raise BadInput(f"verifier.tensor_parallel_size: {problem}")


def check_drafters_against_target(cfg: RunConfig) -> None:
    """train.draft_layer mla (train/draft_config.check_draft_shape), and a flat released drafter to adopt or fine-tune
    (vocab.from_drafter, train.init_from: released_drafter.check_against_target, its config.json alone), against the
    target: before the disk plan reads the target's MLA dimensions, and at stage 01 rather than at stage 03 or 04."""
    released = {key: cfg.resolve_path(value) for key, value in (("vocab.from_drafter", cfg.vocab.from_drafter),
                                                                ("train.init_from", cfg.train.init_from)) if value}
    verifier = Verifier.if_converted(cfg) if released or cfg.train.draft_layer == "mla" else None
    if verifier is None:
        return
    if cfg.train.draft_layer == "mla":
        check_draft_shape(cfg.train, verifier.text_config())
    for key, path in released.items():
        config = read_config(path)  # None where unreadable: the stage that reads the folder names why
        # A speculators folder is compared by stage 04; a malformed config is named where the folder is read whole.
        if config is None or flat_architecture_of(config) is None:
            continue
        drafter = FlatDrafter(path, config, key)
        try:
            drafter.dims  # noqa: B018 - read first: only what a config describes is compared with the target
        except BadInput:
            continue
        with suppress(KeyError, TypeError, ValueError):
            check_against_target(drafter, hidden_size=verifier.hidden_size, vocab_size=verifier.vocab_size,
                                 target=verifier.text_config())


# -- the host's GPUs ---------------------------------------------------------------------------------------


def count_host_gpus() -> tuple[int, str]:
    """How many GPUs this process may use, and how that was found."""
    torch = sys.modules.get("torch")  # counted by torch only where a stage imported it anyway: importing takes seconds
    if torch is not None:
        count = torch.cuda.device_count()
        return count, f"torch.cuda.device_count() is {count}"

    if "CUDA_VISIBLE_DEVICES" in os.environ:
        count = len(gpus.visible_gpus() or [])
        return count, f"CUDA_VISIBLE_DEVICES names {count}"
    count, problem = gpus.listed_count()
    return count, problem if problem == gpus.NOT_ON_PATH else f"nvidia-smi -L lists {count}"


def check_gpu_count(cfg: RunConfig) -> None:
    on_cuda, train_gpus = cfg.device == "cuda", cfg.train.num_gpus
    if not on_cuda and train_gpus == 0:
        return
    count, how = count_host_gpus()
    tp = cfg.verifier.tensor_parallel_size
    if on_cuda and count == 0:
        _host_lacks(f"device: cuda, but this host has no GPU ({how}); set device: cpu, or run on a GPU host "
                    f"(make its GPUs visible: CUDA_VISIBLE_DEVICES, docker run --gpus all)")
    elif on_cuda and tp > count:
        _host_lacks(f"verifier.tensor_parallel_size: {tp}, but this host has {count} GPU(s) ({how}); lower it to "
                    f"at most {count}, or run on a host with {tp} GPUs")
    elif train_gpus > count:
        _host_lacks(f"train.num_gpus: {train_gpus}, but this host has {count} GPU(s) ({how}); lower it to at most "
                    f"{count} (0 trains on the CPU), or run on a host with {train_gpus} GPUs")


# -- the disk budget ---------------------------------------------------------------------------------------


def projected_bytes(cfg: RunConfig, plan, stage_number: int, held: int) -> tuple[int, list]:
    """What the run folder will hold once this stage and the later ones have written what they plan, and the
    stages that add most to it. A stage from this one on holds at most the larger of its planned figure and what its
    folder holds now (a rerun replaces it; an interrupted stage 02's samples are part of its plan, not beside
    it); earlier stages, and files outside the stage folders, count as they are."""
    projected, adding = held, {}
    for stage in plan.stages:
        if stage.number >= stage_number:
            adding[stage] = max(stage.bytes - folder_bytes(cfg.stage_dir(STAGES[stage.number])), 0)
    projected += sum(adding.values())
    # The error line names the stages that make the difference, not a vocabulary map of a few KB.
    return projected, [stage for stage, more in adding.items() if more and more >= 0.01 * sum(adding.values())]


def check_disk_budget(cfg: RunConfig, stage_number: int) -> None:
    budget = cfg.disk_budget_gb
    if budget is None:
        return
    run_dir = cfg.run_dir
    held = folder_bytes(run_dir)
    if held > budget * GB:
        raise BadInput(f"disk_budget_gb: the run folder {run_dir} already holds {amount(held)}, above disk_budget_gb "
                       f"({budget:g} GB); raise disk_budget_gb if the run needs more, or free space in it")

    try:
        plan = plan_for_config(cfg)
    except BadInput:
        if stage_number == 1:  # a target or layer ids the plan cannot read: named by stage 01's checks, or stage 02's
            return
        raise
    if plan is None:  # an embedded target not converted yet: its shape is read once stage 01 has converted it
        return
    projected, adding = projected_bytes(cfg, plan, stage_number, held)
    if projected > budget * GB:
        states = max(adding, key=lambda stage: stage.bytes).number == 2  # the hidden states weigh most
        fix = (", or lower data.num_samples or hidden_states.max_seq_len, or store hidden_states.storage_dtype: fp8"
               if states else ", or free space in the run folder")
        raise BadInput(f"disk_budget_gb: {', '.join(stage.phrase() for stage in adding)} would take the run folder "
                       f"{run_dir} to ~{amount(projected)}, above disk_budget_gb ({budget:g} GB); raise "
                       f"disk_budget_gb to at least {math.ceil(projected / GB)}{fix}")


# -- warnings ------------------------------------------------------------------------------------------------


def speculation_warnings(cfg: RunConfig) -> list[str]:
    """Settings that work but cost speculation what it is for, printed by stage 06's dry run (which serves the
    target speculating): decode context parallelism on TRITON_MLA (docs/engines.md, "Engine settings")."""
    warnings = []
    dcp = cfg.verifier.engine_args.get("decode_context_parallel_size", 1)
    if isinstance(dcp, int) and dcp > 1 and cfg.verifier.attention_backend in (None, "TRITON_MLA"):
        backend = cfg.verifier.attention_backend or "vLLM's choice (TRITON_MLA for an MLA target on SM120)"
        warnings.append(f"verifier.engine_args.decode_context_parallel_size {dcp} with speculation on {backend}: "
                        f"TRITON_MLA verifies drafts through the prefill path under decode context parallelism, "
                        f"slower; keep it at 1 on stock vLLM")
    return warnings
