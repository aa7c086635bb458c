"""patches/speculators_cpu.py: version guard, upstream fingerprints, device pass-through, bf16 argmax, kimi_k2
configs."""

from __future__ import annotations

import json
from unittest import mock

import pytest
import torch

from patches import speculators_cpu
from patches.upstream import changed_sources, source_sha256


def test_refuses_another_speculators_version(monkeypatch):
    monkeypatch.setattr(speculators_cpu, "installed_version", lambda: "0.9.1")
    with pytest.raises(RuntimeError, match=r"targets speculators 0\.9\.0 but 0\.9\.1 is installed"):
        speculators_cpu.apply()


@pytest.mark.parametrize("qualified_name", sorted(speculators_cpu.UPSTREAM_SOURCE_SHA256))
def test_upstream_source_is_the_one_the_patches_were_written_for(qualified_name):
    # Fails when speculators changes a function that a patch replaces, wraps or relies on.
    assert source_sha256(qualified_name) == speculators_cpu.UPSTREAM_SOURCE_SHA256[qualified_name]


def test_fingerprints_see_through_the_installed_wrappers():
    from speculators.train.trainer import Trainer

    speculators_cpu.apply()
    assert Trainer.__init__.__wrapped__ is not None
    assert speculators_cpu.changed_upstream_sources() == []


def test_a_changed_upstream_source_is_refused_by_name():
    name = "speculators.train.cli:build_draft_model"
    speculators_cpu.require_unchanged_sources({name: source_sha256(name)}, "patches/x.py")
    with pytest.raises(RuntimeError, match=r"patches/x\.py targets speculators 0\.9\.0, but these functions differ "
                       r"from that release: speculators\.train\.cli:build_draft_model;"):
        speculators_cpu.require_unchanged_sources({name: "0" * 64}, "patches/x.py")


def test_apply_is_idempotent():
    from speculators.train import checkpointer, trainer

    speculators_cpu.apply()
    wrapped = (trainer.Trainer.__init__, trainer.Trainer.train_epoch, trainer.get_local_rank,
               checkpointer.get_current_device, trainer._StepTimer.mark)
    speculators_cpu.apply()
    assert (trainer.Trainer.__init__, trainer.Trainer.train_epoch, trainer.get_local_rank,
            checkpointer.get_current_device, trainer._StepTimer.mark) == wrapped
    # One layer of wrapping, not two.
    assert not hasattr(trainer.Trainer.__init__.__wrapped__, "__wrapped__")


def test_device_patches_act_only_without_an_accelerator(monkeypatch):
    from speculators.train import checkpointer, trainer

    speculators_cpu.apply()
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    assert trainer.get_local_rank() == torch.device("cpu")
    assert checkpointer.get_current_device() == "cpu"

    # With an accelerator the upstream functions answer, unchanged.
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    assert trainer.get_local_rank() == 0
    assert checkpointer.get_current_device() == "cuda:0"  # upstream's own answer on this GPU-less host


def test_drafter_argmax_over_bf16_is_taken_in_float32_with_the_same_ids(monkeypatch):
    from speculators.models.eagle3 import core, metrics

    speculators_cpu.apply()
    logits = torch.randn(1, 64, 512).to(torch.bfloat16)
    logits[0, :8, 3] = logits[0, :8, 7] = 100.0  # ties: the first index wins either way
    upstream_argmax, seen = torch.argmax, []

    def recording_argmax(input, dim=None, keepdim=False):
        seen.append(input.dtype)
        return upstream_argmax(input, dim=dim, keepdim=keepdim)

    monkeypatch.setattr(torch, "argmax", recording_argmax)
    for module in (core, metrics):  # the forward's draft tokens and the accuracy metrics
        assert torch.equal(module.torch.argmax(logits, dim=-1), upstream_argmax(logits, dim=-1))
        assert module.torch.cat is torch.cat and module.torch.bfloat16 is torch.bfloat16
    assert (upstream_argmax(logits, dim=-1)[0, :8] == 3).all()
    floats = torch.randn(2, 5)
    assert torch.equal(core.torch.argmax(floats, dim=1, keepdim=True), upstream_argmax(floats, dim=1, keepdim=True))
    assert seen == [torch.float32, torch.float32, torch.float32]


def test_argmax_patch_leaves_a_gpu_hosts_torch_alone(monkeypatch):
    from speculators.models.eagle3 import core, metrics

    monkeypatch.setattr(core, "torch", torch)
    monkeypatch.setattr(metrics, "torch", torch)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    speculators_cpu._patch_bf16_argmax()
    assert core.torch is torch and metrics.torch is torch


def test_process_group_patch_acts_only_for_torchrun_ranks_without_an_accelerator(monkeypatch):
    from speculators.train import cli, distributed

    speculators_cpu.apply()
    # Upstream sets these before it fails; restored for the other tests.
    monkeypatch.setattr(distributed, "_is_distributed", False)
    monkeypatch.setattr(distributed, "_local_rank", 0)
    assert cli.maybe_setup_distributed is distributed.maybe_setup_distributed
    # Outside torchrun: upstream's no-op.
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    cli.maybe_setup_distributed()
    assert not distributed.is_distributed()
    # With an accelerator, upstream pins the rank to it (which fails on this GPU-less host).
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match=r"Cannot access accelerator device"):
        cli.maybe_setup_distributed()
    # The gloo branch itself runs under torch.distributed.run: tests/test_training.py.


def test_step_timer_measures_without_an_accelerator():
    from speculators.train.trainer import _StepTimer

    speculators_cpu.apply()
    timer = _StepTimer(enabled=True)
    for name in ("start", "queue", "pre_h2d", "fetch", "fwd", "pre_clip", "bwd", "opt"):
        timer.mark(name)
    assert isinstance(timer.now(), float)
    assert timer.profile(num_tokens=100)["step_ms"] >= 0
    assert _StepTimer(enabled=False).now() is None


def test_kimi_k2_configs_load_through_autoconfig(tmp_path):
    from transformers import AutoConfig, DeepseekV3Config

    speculators_cpu.apply()
    # Kimi-K2's config.json points AutoConfig at remote code; speculators never trusts remote code.
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "kimi_k2",
                "architectures": ["DeepseekV3ForCausalLM"],
                "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"},
                "hidden_size": 7168,
                "num_hidden_layers": 61,
                "vocab_size": 163840,
                "qk_rope_head_dim": 64,
            }
        )
    )
    config = AutoConfig.from_pretrained(tmp_path, trust_remote_code=False)
    assert isinstance(config, DeepseekV3Config)
    assert config.model_type == "kimi_k2"
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (7168, 61, 163840)


def test_kimi_k25_nested_config_loads_with_kimi_k2_text_config(tmp_path):
    from speculators.models.utils import get_verifier_config
    from transformers import DeepseekV3Config

    speculators_cpu.apply()
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "kimi_k25",
                "architectures": ["KimiK25ForConditionalGeneration"],
                "text_config": {"model_type": "kimi_k2", "hidden_size": 7168, "num_hidden_layers": 61,
                                "vocab_size": 163840},
            }
        )
    )
    text_config = get_verifier_config(str(tmp_path))
    assert isinstance(text_config, DeepseekV3Config)
    assert (text_config.hidden_size, text_config.num_hidden_layers) == (7168, 61)


# ---------------------------------------------------------------------------------------------------
# patches/torch_process_group_timeout.py


def test_the_process_group_timeout_patch_relies_on_the_reader_it_was_written_for():
    from patches import torch_process_group_timeout
    from patches.upstream import changed_sources

    # Fails when torch changes how a process group's default timeout is chosen.
    assert changed_sources(torch_process_group_timeout.UPSTREAM_SOURCE_SHA256) == []


def test_the_process_group_timeout_is_raised_for_every_backend_and_never_lowered(monkeypatch):
    from datetime import timedelta

    from torch.distributed import distributed_c10d

    from patches import torch_process_group_timeout

    monkeypatch.setattr(distributed_c10d, "default_pg_timeout", timedelta(minutes=30))
    monkeypatch.setattr(distributed_c10d, "default_pg_nccl_timeout", timedelta(minutes=10))
    torch_process_group_timeout.apply(3600)
    torch_process_group_timeout.apply(60)
    assert distributed_c10d._get_default_timeout(distributed_c10d.Backend.NCCL) == timedelta(hours=1)
    assert distributed_c10d._get_default_timeout(distributed_c10d.Backend.GLOO) == timedelta(hours=1)


def test_the_process_group_timeout_patch_refuses_other_torch_versions(monkeypatch):
    import importlib

    from patches import torch_process_group_timeout

    monkeypatch.setattr(torch, "__version__", "2.14.0")
    with pytest.raises(RuntimeError, match=r"targets torch 2\.13\.0 but 2\.14\.0 is installed"):
        importlib.reload(torch_process_group_timeout)
    monkeypatch.undo()
    importlib.reload(torch_process_group_timeout)


# ---------------------------------------------------------------------------------------------------
# patches/vllm_kernel_rebind.py


def test_vllm_kernel_scan_is_the_one_the_patch_was_written_for():
    from patches import vllm_kernel_rebind
    from patches.upstream import changed_sources

    # Fails when vLLM changes the scan whose use of `vars` the patch relies on.
    assert changed_sources(vllm_kernel_rebind.UPSTREAM_SOURCE_SHA256) == []


def test_the_kernel_scan_fails_on_llvmlite_unpatched_and_still_rebinds_every_holder_patched(monkeypatch):
    import builtins
    import sys
    import types

    import llvmlite.binding.ffi  # noqa: F401 - numba's, loaded with vLLM's Kimi-K2.5 model class
    from vllm.triton_utils import dispatcher

    from patches import vllm_kernel_rebind

    def kernel():
        pass

    def wrapper():
        pass

    holder = types.ModuleType("kernel_holder")
    holder.imported_copy = kernel  # `from module import kernel`
    holder.launcher = types.SimpleNamespace(kernel=kernel)  # a JIT warm-up owner's instance attribute
    monkeypatch.setitem(sys.modules, holder.__name__, holder)
    monkeypatch.setattr(dispatcher, "vars", builtins.vars, raising=False)  # upstream's: the builtin
    with pytest.raises(AttributeError, match="_lib_fn_wrapper' object has no attribute 'get'"):
        dispatcher._rebind_kernels([(kernel, wrapper)])

    vllm_kernel_rebind.apply()
    dispatcher._rebind_kernels([(kernel, wrapper)])
    assert holder.imported_copy is wrapper and holder.launcher.kernel is wrapper


# ---------------------------------------------------------------------------------------------------
# patches/vllm_cpu_rope.py


def test_the_rope_patch_wraps_the_forward_cpu_it_was_written_for():
    from patches import vllm_cpu_rope
    from patches.upstream import changed_sources

    assert changed_sources(vllm_cpu_rope.UPSTREAM_SOURCE_SHA256, vllm_cpu_rope.upstream_sha256) == []


def test_every_head_of_an_mla_query_is_rotated_at_its_tokens_position_on_the_cpu(monkeypatch):
    """The query as vLLM's MLA layer hands it over, the rope part of [tokens, heads, nope + rope] (a slice, the result
    written back into it), the key one head; vLLM's own torch rotation is the reference."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    from patches import vllm_cpu_rope

    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(64, max_position=64, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                        is_neox_style=False)
    # Valid positions past the batch's five: upstream's kernel reads there (the engine's buffer holds older ones).
    positions = (torch.arange(32) + 3)[:5]
    query, key = torch.randn(5, 4, 32 + 64), torch.randn(5, 1, 64)
    want_q, want_k = rope.forward_native(positions, query[..., 32:].clone(), key.clone())

    def mla_rope():
        q, k = query.clone(), key.clone()
        q[..., 32:], k = rope.forward_cpu(positions, q[..., 32:], k)
        return q, k

    monkeypatch.setattr(RotaryEmbedding, "forward_cpu", vllm_cpu_rope._upstream)
    q, k = mla_rope()
    assert torch.allclose(k, want_k, atol=1e-6) and torch.allclose(q[0, 0, 32:], want_q[0, 0], atol=1e-6)
    assert not torch.allclose(q[:, 1:, 32:], want_q[:, 1:], atol=1e-2)  # upstream: other heads at other positions
    vllm_cpu_rope.apply()
    q, k = mla_rope()
    assert torch.allclose(q[..., 32:], want_q, atol=1e-6) and torch.allclose(k, want_k, atol=1e-6)
    assert torch.equal(q[..., :32], query[..., :32])


def test_the_vllm_private_names_the_product_uses_are_those_it_was_written_for():
    """eagle_pipeline/vllm_config.py keeps patches/' rules for the vLLM private names it (and the vllm_logits check)
    relies on: one fingerprint per upstream function, compared here with the installed vLLM, and a refusal naming
    both releases on another one."""
    from eagle_pipeline import vllm_config

    assert changed_sources(vllm_config.UPSTREAM_SOURCE_SHA256) == []
    vllm_config.require_written_for()
    with mock.patch.object(vllm_config, "TARGET_VLLM_VERSION", "0.31.0"), \
            pytest.raises(RuntimeError, match=r"targets vLLM 0\.31\.0 but 0\.32\.0 is installed"):
        vllm_config.require_written_for.__wrapped__()
    name = next(iter(vllm_config.UPSTREAM_SOURCE_SHA256))
    with mock.patch.dict(vllm_config.UPSTREAM_SOURCE_SHA256, {name: "0" * 64}), \
            pytest.raises(RuntimeError, match=f"differ from that release: {name}"):
        vllm_config.require_written_for.__wrapped__()
