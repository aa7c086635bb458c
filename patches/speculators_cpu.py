"""Runtime patches that let speculators 0.9.0's own trainer run on a CPU-only host. Targets speculators 0.9.0.

speculators' `Trainer` and checkpointer assume an accelerator. Without one:
  - `Trainer.__init__` takes `get_local_rank()` (0) as the device and moves the model and every batch
    to it: "Cannot access accelerator device when none is available".
  - `_StepTimer.mark` / `.now` call `torch.accelerator.synchronize()` on logged steps: same error.
  - `Trainer.__init__` falls back to autocast `device_type="cuda"`, which torch silently disables on a
    CPU host; bf16 autocast then never happens and an fp32 run cannot be told from a bf16 one.
  - `SingleGPUCheckpointer` loads resumed weights and optimizer state onto `get_current_device()`,
    which answers "cuda:0" without an accelerator, so resuming a run fails.
  - `distributed.maybe_setup_distributed` (under torchrun) pins each rank to accelerator LOCAL_RANK
    ("Cannot access accelerator device when none is available") and takes that device's backend, so
    CPU processes cannot form a process group; the patch starts a gloo group instead and sets the
    same topology state.
Two more points are plain bugs, also on GPU hosts:
  - `--max-steps` stops the epoch that reaches it, but `run_training` then starts every remaining epoch
    and trains one more step in each.
  - `--from-pretrained` loads the drafter in the dtype its checkpoint was saved in (bf16), so fine-tuning
    keeps bf16 master weights, against speculators' own rule that they are fp32; with fp32 hidden states
    (the CPU setting) the first matmul then fails on mixed dtypes.
One is a speed fix on the CPU:
  - torch's CPU `argmax` over a bfloat16 tensor runs several times slower than over the same values in
    float32, and the drafter's forward (`Eagle3DraftModel.forward`, the draft tokens of each position) and its
    metrics (`compute_metrics`, predicted and target ids) take it on bf16 logits under autocast (its share of
    a step: docs/measurements.md, "Measured on the 2-core CPU machines"). Those two modules get a `torch`
    whose `argmax` upcasts a bfloat16 CPU tensor first; float32 holds every bfloat16 value exactly, so the
    ids are the same.
And one is a transformers gap: Kimi-K2 configs (`model_type: kimi_k2` with an `auto_map` to remote
code) fail in `AutoConfig.from_pretrained` unless `trust_remote_code`, which speculators never passes.
Kimi-K2's text model is DeepSeek-V3, so registering a `DeepseekV3Config` subclass under `kimi_k2` makes
such configs load (Kimi-K2.5's `kimi_k25` is native in transformers 5.19 and needs nothing).

`apply()` installs all of them; it is idempotent. The device patches decide at call time and only act
when `torch.accelerator.is_available()` is False, so on a GPU host speculators behaves as shipped.

Each patched (or relied-upon) upstream function is fingerprinted in `UPSTREAM_SOURCE_SHA256`; `apply()`
refuses another speculators version and refuses when any fingerprint no longer matches, and
tests/test_patches.py fails on the same condition, so an upgrade forces a re-check of every patch.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import time
import types
from collections.abc import Callable
from typing import Any

import torch

from patches import upstream
from patches.upstream import changed_sources, require_version, source_sha256

TARGET_VERSION = "0.9.0"

# sha256 of inspect.getsource() of the upstream objects these patches wrap, replace or depend on,
# as shipped in speculators 0.9.0. Keys are "module:qualified.name".
UPSTREAM_SOURCE_SHA256: dict[str, str] = {
    # Device: replaced in the trainer's namespace; the trainer uses its result as a torch device.
    "speculators.train.distributed:get_local_rank": "98a393d856860bc662ff1df4947b2cd40667bf5f1aa703d08a6d643eb87f03b4",
    # Wrapped: sets device_type (autocast) after upstream's __init__.
    "speculators.train.trainer:Trainer.__init__": "c323c45e45491c7375a0ba3af91f5494af7ba21d57dd39ce4fdd6f78c78fcd6d",
    # Consumers of self.local_rank / self.device_type that make the two patches above sufficient.
    "speculators.train.trainer:Trainer.setup_model": "b250d0e72b307722911a400e43824923a71942393ac74bbfbb9be35be1060938",
    "speculators.train.trainer:Trainer.val_epoch": "10da9d3279842a4c5316aea0d9e563a2667a78efee172ab066a14b0ba84a4b44",
    # Wrapped: synchronize only with an accelerator.
    "speculators.train.trainer:_StepTimer.mark": "5d798b0a65c2de110f4f93655402e91bf737d3bbddf86bb6ad4f158a164ebf0e",
    "speculators.train.trainer:_StepTimer.now": "e47c9a9e6c78ac8c6b55850529f09159418baa06f1589610264f62c8fe476581",
    # Replaced in the checkpointer's namespace; its two users below.
    "speculators.utils.util:get_current_device": "68b44f84e1897e958d90be746d444d5df9096b6b89db5aff7f2642e134571a2e",
    "speculators.train.checkpointer:SingleGPUCheckpointer.load_model_state_dict":
        "ee677396facb87fbb732d9dd4de5a2726cf543600fb9f5eb50b75e2eaa0ef1b9",
    "speculators.train.checkpointer:SingleGPUCheckpointer.load_optimizer_state_dict":
        "3145716bb1072077e9427b5783437f65ae1b1cd2ecddd1dc174e1fc50310f068",
    # Replaced on the CPU (gloo); the CPU branch sets the module state these two define and reset.
    "speculators.train.distributed:maybe_setup_distributed":
        "ce8ff9c12a247fe797346cfd7b3fc852c6f2b0632676a01249b02fe9f77acf8c",
    "speculators.train.distributed:maybe_destroy_distributed":
        "b8270d7f1d89bb33162d86e6980dc73a75cf425bfebfd73002a341faf25bbb24",
    "speculators.train.distributed:_init_sp_process_groups":
        "15dabcf74ef4a1795611394e197ac4daa233e8f0442c7e4e6f0c0b418f339bcc",
    # Wrapped for --max-steps across epochs (and a device consumer, like val_epoch).
    "speculators.train.trainer:Trainer.train_epoch": "a84f3c8000da1b71a9a0eab955b0398ce23b717986df94b65b9f6c71c054ac8c",
    "speculators.train.trainer:Trainer.run_training":
        "83e395bd403ee08f5d008fe6fa0695f21db4ba7cba7dc26d5d3fde312c74235c",
    # Wrapped: fp32 master weights for --from-pretrained.
    "speculators.train.cli:build_draft_model": "53a1b6fb54a8bb16ecc19850055716610a5d3e7463e174e53f74aa7f326977e3",
    # Their module's `torch` is swapped for one whose argmax upcasts bf16 on the CPU.
    "speculators.models.eagle3.core:Eagle3DraftModel.forward":
        "f682b266d1b18786842b8d031697e9e396acc1d710ed55b343ef6fd5d3a48df0",
    "speculators.models.eagle3.metrics:compute_metrics":
        "5dd4345b708ab81a46cdb86b9dba8ec96f949549d48c658293d33799bdf404d9",
    # Not patched: eagle_pipeline/train/ relies on the checkpoint layout these write and read
    # (<epoch>/ with model, optimizer, scheduler, then training_state.json last; resume from the highest
    # numbered folder) and on the metric records and logger set-up these emit.
    "speculators.train.trainer:Trainer.maybe_save_checkpoint":
        "a47374ee736fb108fe596b1b3474140276790abc77536fac263476cd4f11efce",
    "speculators.train.trainer:Trainer._save_training_state":
        "1aacc642607ebb5b21d9e674a29e5a67732ab1e80e5d5989dbd177b6c465cf2e",
    "speculators.train.trainer:Trainer.setup_trainer":
        "4d9caeffa2ee477ec73202e3df058b96958451efe35a752318e171d12293e2c7",
    "speculators.train.checkpointer:BaseCheckpointer._get_previous_epoch":
        "8b1fbdd5670f8ee181bea943cf688780eb3cb9af903cc7cced4c86d1a7462533",
    "speculators.train.checkpointer:SingleGPUCheckpointer.save_checkpoint":
        "31124f3a6065875ccc95860f4da7a892dd12b2f6fe67d08655c142fc76759e79",
    "speculators.train.logger:setup_metric_logger": "0ffdbfe98008f0e5851b46f24a8607a833a26d938e4e7165292c385709b2c758",
    "speculators.train.logger:setup_root_logger": "a1aac32239578075a0322d4211b4167f812beb0a0e8c59089ca6b2cfa204d2eb",
}

_applied = False


def installed_version() -> str:
    return importlib.metadata.version("speculators")


def check_version() -> None:
    """Raise unless the installed speculators is the version these patches were written against."""
    require_version("patches/speculators_cpu.py", "speculators", installed_version(), TARGET_VERSION,
                    "re-check each patch against the new sources, then update TARGET_VERSION and "
                    "UPSTREAM_SOURCE_SHA256")


def changed_upstream_sources() -> list[str]:
    """This module's fingerprinted upstream functions whose source differs from speculators 0.9.0."""
    return changed_sources(UPSTREAM_SOURCE_SHA256)


def require_unchanged_sources(fingerprints: dict[str, str], patch_file: str,
                              sha256: Callable[[str], str] = source_sha256) -> None:
    """Raise unless every upstream function a patch module fingerprints still has the source it was written
    against (the check of every module in patches/ that patches speculators)."""
    upstream.require_unchanged_sources(fingerprints, patch_file, f"speculators {TARGET_VERSION}", sha256)


def _no_accelerator() -> bool:
    return not torch.accelerator.is_available()


def _patch_trainer_device() -> None:
    from speculators.train import trainer as trainer_module

    upstream_get_local_rank = trainer_module.get_local_rank

    @functools.wraps(upstream_get_local_rank)
    def get_local_rank_or_cpu():
        # The trainer passes this straight to .to(); 0 means "accelerator 0", which does not exist here.
        if _no_accelerator():
            return torch.device("cpu")
        return upstream_get_local_rank()

    trainer_module.get_local_rank = get_local_rank_or_cpu

    upstream_init = trainer_module.Trainer.__init__

    @functools.wraps(upstream_init)
    def init_with_cpu_autocast(self, *args, **kwargs):
        upstream_init(self, *args, **kwargs)
        if _no_accelerator():
            # Upstream falls back to "cuda", which torch disables on a CPU host without a word.
            self.device_type = "cpu"

    trainer_module.Trainer.__init__ = init_with_cpu_autocast


def _patch_step_timer() -> None:
    from speculators.train.trainer import _StepTimer

    upstream_mark = _StepTimer.mark
    upstream_now = _StepTimer.now

    @functools.wraps(upstream_mark)
    def mark(self, name: str) -> None:
        if _no_accelerator():
            # Nothing runs asynchronously on the CPU, so there is nothing to wait for.
            if self.enabled:
                self._marks[name] = time.perf_counter()
            return
        upstream_mark(self, name)

    @functools.wraps(upstream_now)
    def now(self) -> float | None:
        if _no_accelerator():
            return time.perf_counter() if self.enabled else None
        return upstream_now(self)

    _StepTimer.mark = mark
    _StepTimer.now = now


def _patch_checkpointer_device() -> None:
    from speculators.train import checkpointer as checkpointer_module

    upstream_get_current_device = checkpointer_module.get_current_device

    @functools.wraps(upstream_get_current_device)
    def get_current_device_or_cpu() -> str:
        # Upstream answers "cuda:0" when there is no accelerator; resumed tensors must land on the CPU.
        if _no_accelerator():
            return "cpu"
        return upstream_get_current_device()

    checkpointer_module.get_current_device = get_current_device_or_cpu


def _patch_cpu_process_group() -> None:
    from speculators.train import cli
    from speculators.train import distributed as distributed_module

    upstream_setup = distributed_module.maybe_setup_distributed

    @functools.wraps(upstream_setup)
    def maybe_setup_distributed(sp_size: int = 1) -> None:
        if not _no_accelerator() or "LOCAL_RANK" not in os.environ:
            return upstream_setup(sp_size)
        # Upstream's own steps without the accelerator: no device to pin, gloo is the CPU backend.
        import torch.distributed as dist

        dist.init_process_group("gloo")
        distributed_module._local_rank = int(os.environ["LOCAL_RANK"])
        distributed_module._is_distributed = True
        distributed_module._rank = dist.get_rank()
        distributed_module._world_size = dist.get_world_size()
        distributed_module._init_sp_process_groups(distributed_module._rank, distributed_module._world_size, sp_size)
        distributed_module.logger.info(
            f"Started distributed (gloo) with local_rank={distributed_module._local_rank}, "
            f"dp_size={distributed_module._dp_size}, sp_size={distributed_module._sp_size}",
            extra={"override_rank0_filter": True},
        )
        return None

    # cli.main calls the name it imported.
    distributed_module.maybe_setup_distributed = maybe_setup_distributed
    cli.maybe_setup_distributed = maybe_setup_distributed


class _MaxStepsReached(Exception):
    """Raised at the start of an epoch once --max-steps optimizer steps have been taken."""


def _patch_max_steps_across_epochs() -> None:
    from speculators.train.trainer import Trainer

    upstream_train_epoch = Trainer.train_epoch
    upstream_run_training = Trainer.run_training

    @functools.wraps(upstream_train_epoch)
    def train_epoch(self, epoch: int, *args, **kwargs):
        max_steps = self.config.max_steps
        if max_steps is not None and self.global_step >= max_steps:
            # The previous epoch was checkpointed and validated; starting this one would take a step.
            raise _MaxStepsReached
        return upstream_train_epoch(self, epoch, *args, **kwargs)

    @functools.wraps(upstream_run_training)
    def run_training(self, *args, **kwargs):
        try:
            return upstream_run_training(self, *args, **kwargs)
        except _MaxStepsReached:
            return None

    Trainer.train_epoch = train_epoch
    Trainer.run_training = run_training


def _patch_fine_tune_master_weights() -> None:
    from speculators.train import cli

    upstream_build_draft_model = cli.build_draft_model

    @functools.wraps(upstream_build_draft_model)
    def build_draft_model(args, *rest, **kwargs):
        model = upstream_build_draft_model(args, *rest, **kwargs)
        if args.from_pretrained:
            # A fresh draft is built in fp32; one loaded from a checkpoint comes back in the saved bf16.
            model = model.float()
        return model

    cli.build_draft_model = build_draft_model


class _TorchWithUpcastArgmax(types.ModuleType):
    """`torch` for a speculators module, except that `argmax` upcasts a bfloat16 CPU tensor to float32 first."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def argmax(input: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
        if input.dtype == torch.bfloat16 and input.device.type == "cpu":
            input = input.float()
        return torch.argmax(input, dim=dim, keepdim=keepdim)


def _patch_bf16_argmax() -> None:
    from speculators.models.eagle3 import core, metrics

    if not _no_accelerator():  # a GPU host compiles the forward (torch.compile): leave its torch alone
        return
    for module in (core, metrics):
        module.torch = _TorchWithUpcastArgmax()


def _register_kimi_k2_config() -> None:
    from transformers import AutoConfig, DeepseekV3Config
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "kimi_k2" in CONFIG_MAPPING:
        return

    class KimiK2Config(DeepseekV3Config):
        """Kimi-K2's config: a DeepSeek-V3 text model under Moonshot's model_type."""

        model_type = "kimi_k2"

    AutoConfig.register("kimi_k2", KimiK2Config)


def apply() -> None:
    """Install every patch once; raises RuntimeError on any speculators other than 0.9.0."""
    global _applied
    check_version()
    if _applied:
        return
    require_unchanged_sources(UPSTREAM_SOURCE_SHA256, "patches/speculators_cpu.py")
    _register_kimi_k2_config()
    _patch_trainer_device()
    _patch_step_timer()
    _patch_checkpointer_device()
    _patch_cpu_process_group()
    _patch_max_steps_across_epochs()
    _patch_fine_tune_master_weights()
    _patch_bf16_argmax()
    _applied = True
