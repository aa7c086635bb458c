"""The engine rehearsal (eagle_pipeline/plan/rehearsal.py): every engine a stage starts, configured by vLLM's own
code without loading a model, with the attention backend vLLM's selector returns for each kind of layer.

The Kimi-K2.5 config (`configs/kimi-k2.5-10.yaml`, device cuda) is checked on this CPU machine against a tiny
stand-in of its target (tests/test_kimi_vllm.py: DeepSeek-V3 MLA layers in Kimi-K2.5's nested layout): the
selection is CUDA's own (`vllm.platforms.cuda` at the GPU host's compute capability 12.0), which refuses what
vLLM's CPU platform silently replaces. No engine starts; each test imports vLLM and configures engines only.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from conftest import REPO, run_stage_in_process
from released_drafter_standin import KIMI_STANDIN, write_released_standin
from test_kimi_vllm import make_kimi_k25

from eagle_pipeline.config import load_config
from eagle_pipeline.errors import BadInput

KIMI_CONFIG = REPO / "configs" / "kimi-k2.5-10.yaml"
# The Kimi config's settings that the tiny stand-in cannot take (its depth, width, context and 4 heads, which
# tensor parallelism of 8 would not divide); every engine setting of the config stays.
STANDIN_FIT = {"hidden_states": {"layer_ids": [1, 2, 3], "max_seq_len": 1024},
               "train": {"draft_shape": {"hidden_size": 64}}, "generation": {"max_tokens": 512}}
VERIFIER_FIT = {"max_model_len": 2048, "tensor_parallel_size": 1}
CUDA = "cuda sm_120"


@pytest.fixture(scope="module")
def standin(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("rehearsal")
    make_kimi_k25(root / "kimi")
    return root


def kimi_config_file(root: Path, name: str, verifier: dict | None = None, serve: dict | None = None,
                     train: dict | None = None) -> Path:
    path = root / f"{name}.yaml"
    data = {"extends": str(KIMI_CONFIG), "run_name": name, "data_root": str(root / "data"), **STANDIN_FIT,
            "verifier": {"path": str(root / "kimi"), **VERIFIER_FIT, **(verifier or {})}, "serve": serve or {},
            "train": {**STANDIN_FIT["train"], **(train or {})}}
    path.write_text(yaml.safe_dump(data))
    return path


def kimi_config(root: Path, name: str = "k", **sections):
    return load_config(kimi_config_file(root, name, **sections), [])


def test_every_engine_of_the_kimi_config_is_configured_by_cudas_selector(standin, capsys):
    from eagle_pipeline.plan.rehearsal import before_first_load

    before_first_load(kimi_config(standin), 1)  # stage 01 on the GPU host: every stage's engines
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("  engine ")]
    assert "engine rehearsal of stages 01, 02, 05, 06" in out, out  # stage 04 starts none offline
    # What CUDA's selector alone cannot rehearse on this machine without a GPU is said once.
    assert out.count("not rehearsed without a GPU: CUDA graph sizes, chunked prefill, scheduler defaults") == 1, out
    # 01 answers, 02 captures, 05 checks the drafter's load, 06 serves none and EAGLE-3, the four engine
    # variants of the config, and the replay's capture.
    names = [line.split(" (")[0].split(":")[0].strip() for line in lines]
    assert names == ["engine 01 answering engine", "engine 02 hidden-state capture", "engine 05 drafter load check",
                     "engine 06 server none", "engine 06 server eagle3", "engine 06 server schedule",
                     *[f"engine 06 engine variant {i}" for i in range(1, 5)], "engine 06 replay capture"], out
    assert all(CUDA in line and "target MLA -> TRITON_MLA" in line for line in lines), out
    eagle3 = next(line for line in lines if "server eagle3" in line)
    assert "drafter full attention -> TRITON_ATTN" in eagle3 and "runner V2" in eagle3 and "block 16" in eagle3, eagle3
    # The schedule stage 06 confirms, in the shape a choice over the config's levels [1, 4, 16, 64] takes, passes
    # the check vLLM's scheduler makes when its engine starts.
    schedule = next(line for line in lines if "server schedule" in line)
    assert "(schedule [[1, 2, 3], [3, 64, 0]])" in schedule and "drafter full attention -> TRITON_ATTN" in schedule
    variant = next(line for line in lines if "verifier.model_runner=v1)" in line)
    assert "runner V1" in variant, variant



def test_the_capture_engines_run_eager_on_cuda_and_the_lines_show_what_offline_engines_set(standin):
    """A capture only prefills: on CUDA its engines run eager (no torch.compile, no graph capture at start), and
    their lines say so beside their sizing; the load check's says it builds the drafter in one process."""
    from eagle_pipeline.drafter_checks.vllm_load import load_check_engine_kwargs
    from eagle_pipeline.engine import capture_engine_kwargs, llm_kwargs
    from eagle_pipeline.plan.rehearsal import check_engines, own_settings

    cfg = kimi_config(standin, "eager")
    assert not cfg.verifier.enforce_eager and capture_engine_kwargs(cfg)["extra_engine_args"]["enforce_eager"]
    cpu = cfg.model_copy(update={"device": "cpu"})
    assert not capture_engine_kwargs(cpu)["extra_engine_args"]["enforce_eager"]  # the CPU captures no graphs
    lines = {item.engine.name: item.line() for item in check_engines(cfg, (2, 6), show=False)}
    for name in ("hidden-state capture", "replay capture"):
        assert "enable_prefix_caching=False" in lines[name] and "enforce_eager=True" in lines[name], lines[name]
    assert "enforce_eager" not in lines["server eagle3"], lines["server eagle3"]
    tp8 = cfg.model_copy(update={"verifier": cfg.verifier.model_copy(update={"tensor_parallel_size": 8})})
    engine = {k: v for k, v in llm_kwargs(tp8, "t").items() if k != "model"}
    assert own_settings(tp8, load_check_engine_kwargs("t", "d", engine)) == {"variant": "tensor_parallel_size=1"}

def test_stage_05_built_the_drafter_under_the_targets_mla_backend_which_cuda_refuses(standin):
    """The load check used to build the drafter without its own settings: the Llama drafter's layers then asked
    for the target's TRITON_MLA, which the CPU platform replaces and CUDA refuses. With the drafter's settings,
    as stage 06 serves it, CUDA accepts it."""
    from eagle_pipeline.drafter_checks.vllm_load import load_check_engine_kwargs
    from eagle_pipeline.engine import drafter_engine_settings, llm_kwargs
    from eagle_pipeline.vllm_config import check_engine

    cfg = kimi_config(standin)
    drafter = write_released_standin(standin / "drafter", KIMI_STANDIN)
    target = str(standin / "kimi")
    engine = {k: v for k, v in llm_kwargs(cfg, target).items() if k != "model"}
    without = load_check_engine_kwargs(target, str(drafter), engine)  # the drafter's settings left out
    with_settings = load_check_engine_kwargs(target, str(drafter), engine, drafter_engine_settings(cfg))

    assert check_engine("cpu", without, kv_cache=False).ok  # vLLM's CPU platform lets it through
    refused = check_engine("cuda", without, kv_cache=False)
    drafter_layer = refused.layers[1]
    assert not refused.ok and drafter_layer.requested == "TRITON_MLA", refused
    assert "non-MLA not supported" in drafter_layer.error, drafter_layer
    accepted = check_engine("cuda", with_settings, kv_cache=False)
    assert accepted.ok and [layer.backend for layer in accepted.layers] == ["TRITON_MLA", "TRITON_ATTN"], accepted


def test_an_unset_drafter_backend_inherits_the_targets_on_runner_v2_and_is_refused(standin):
    from eagle_pipeline.plan.rehearsal import check_engines

    cfg = kimi_config(standin, "unset", serve={"drafter_attention_backend": None})
    with pytest.raises(BadInput) as refusal:
        check_engines(cfg, (5,), show=False)
    message = str(refusal.value)
    assert message.startswith("engine rehearsal: stage 05 drafter load check"), message
    assert "serve.drafter_attention_backend" in message and "non-MLA not supported" in message, message
    # Model runner V1 chooses the drafter's backend afresh instead of inheriting it.
    v1 = kimi_config(standin, "unset-v1", verifier={"model_runner": "v1"}, serve={"drafter_attention_backend": None})
    (done,) = check_engines(v1, (5,), show=False)
    assert done.result.runner == "V1" and done.result.layers[1].backend == "FLASH_ATTN", done.line()


def test_a_backend_this_machine_cannot_import_is_named_not_refused(standin):
    from eagle_pipeline.plan.rehearsal import check_engines

    cfg = kimi_config(standin, "fi", verifier={"attention_backend": "FLASHINFER_MLA", "kv_cache_dtype": "fp8"})
    (done,) = check_engines(cfg, (1,), show=False)
    assert "target MLA -> cannot be checked here (asked FLASHINFER_MLA)" in done.line(), done.line()
    assert "flashinfer" in done.result.layers[0].error, done.result



def test_a_kv_cache_dtype_refusal_names_the_key_that_set_the_dtype(standin):
    """The drafter takes the target's KV-cache dtype unless serve.drafter_kv_cache_dtype names one: an fp8 cache its
    backend refuses names both keys; a target backend refusing its dtype names verifier.kv_cache_dtype."""
    from eagle_pipeline.plan.rehearsal import check_engines

    drafter = kimi_config(standin, "fp8-drafter", verifier={"kv_cache_dtype": "fp8"},
                          serve={"drafter_attention_backend": "FLASH_ATTN", "engine_variants": []})
    with pytest.raises(BadInput) as refusal:
        check_engines(drafter, (5,), show=False)
    assert "kv_cache_dtype not supported" in str(refusal.value), refusal.value
    assert ("set serve.drafter_kv_cache_dtype (unset, the drafter's is verifier.kv_cache_dtype) to a KV-cache dtype "
            "its backend takes, or serve.drafter_attention_backend to a backend that takes fp8") in str(refusal.value)
    target = kimi_config(standin, "e5m2", verifier={"kv_cache_dtype": "fp8_e5m2"})
    with pytest.raises(BadInput) as refusal:
        check_engines(target, (1,), show=False)
    assert "set verifier.kv_cache_dtype to a KV-cache dtype its backend takes" in str(refusal.value), refusal.value

def test_the_cpu_mla_block_size_conflict_is_found_before_any_engine_starts(standin):
    """On the CPU, CPU_MLA takes KV blocks of 16 and the Llama drafter's CPU_ATTN multiples of 32: the EAGLE-3
    server cannot start (docs/engines.md, "The CPU MLA limit"); the rehearsal says so without starting it."""
    from eagle_pipeline.plan.rehearsal import check_engines

    cfg = kimi_config(standin, "cpu").model_copy(update={"device": "cpu"})
    cfg = cfg.model_copy(update={"verifier": cfg.verifier.model_copy(update={"attention_backend": "CPU_MLA"}),
                                 "serve": cfg.serve.model_copy(update={"drafter_attention_backend": None,
                                                                       "engine_variants": []})})
    with pytest.raises(BadInput) as refusal:
        check_engines(cfg, (6,), show=False)
    assert "stage 06 server eagle3" in str(refusal.value), refusal.value
    assert "No common block size for 16 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])" in str(refusal.value)


def test_the_dry_run_prints_a_line_per_engine_and_refuses_what_cuda_refuses(standin, capsys):
    config = kimi_config_file(standin, "dry", serve={"drafter_attention_backend": None})
    code, out, err = run_stage_in_process("05_convert.py", config, capsys, "--dry-run")
    assert code == 2 and "engine 05 drafter load check: target MLA -> TRITON_MLA; drafter full attention -> " \
                          "REFUSED (asked TRITON_MLA)" in out, out + err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "serve.drafter_attention_backend" in errors[0], err
    assert not (standin / "data").exists(), "a dry run writes nothing"


def test_an_mla_drafter_takes_cpu_mla_blocks_of_16_with_its_target(standin, tmp_path):
    """An MLA drafter (vLLM's Eagle3DeepseekV2ForCausalLM, the Kimi-K2.5 recipe's) on CPU_MLA like its target: both
    layers take KV blocks of 16, so the block-size conflict of a Llama drafter (the test above) does not arise and
    the rehearsal accepts the EAGLE-3 server (docs/engines.md, "The CPU MLA limit")."""
    from released_drafter_standin import write_mla_standin

    from eagle_pipeline.plan.rehearsal import check_engines

    drafter = write_mla_standin(tmp_path / "mla-drafter")
    cfg = kimi_config(standin, "cpu-mla", serve={"drafter": str(drafter)}).model_copy(update={"device": "cpu"})
    cfg = cfg.model_copy(update={"verifier": cfg.verifier.model_copy(update={"attention_backend": "CPU_MLA"}),
                                 "serve": cfg.serve.model_copy(update={"drafter_attention_backend": "CPU_MLA",
                                                                       "engine_variants": []})})
    done = check_engines(cfg, (6,), show=False)  # a refusal would raise BadInput
    eagle3 = next(item for item in done if item.engine.name == "server eagle3")
    assert [(layer.kind, layer.attention, layer.backend) for layer in eagle3.result.layers] == [
        ("target", "MLA", "CPU_MLA"), ("drafter", "MLA", "CPU_MLA")], eagle3.line()
    assert eagle3.result.block_size == 16, eagle3.line()


# An MLA drafter on the stand-in: its layer derived from the verifier (the Kimi config's Llama draft_shape dropped).
MLA_TRAIN = {"draft_layer": "mla", "draft_shape": None}


def test_before_stage_05_the_rehearsal_plans_the_mla_drafter_train_draft_layer_asks_for(standin):
    """Stage 05 has not run: the rehearsal plans the drafter stage 04 will train, so with train.draft_layer mla an
    Eagle3DeepseekV2ForCausalLM whose layers take CPU_MLA beside the CPU_MLA target (blocks of 16), where the
    Llama-shaped drafter the same settings would plan is refused for the block-size conflict."""
    from eagle_pipeline.plan.rehearsal import check_engines

    def cpu(name: str, **train):
        cfg = kimi_config(standin, name, train=train, serve={"drafter_attention_backend": "CPU_MLA"})
        return cfg.model_copy(update={
            "device": "cpu", "verifier": cfg.verifier.model_copy(update={"attention_backend": "CPU_MLA"}),
            "serve": cfg.serve.model_copy(update={"engine_variants": []})})

    mla = cpu("cpu-mla-planned", **MLA_TRAIN)
    assert not (mla.stage_dir("05_convert") / "vllm").exists()
    done = check_engines(mla, (5, 6), show=False)  # a refusal would raise BadInput
    for name in ("drafter load check", "server eagle3"):
        item = next(item for item in done if item.engine.name == name)
        assert [(layer.kind, layer.attention, layer.backend) for layer in item.result.layers] == [
            ("target", "MLA", "CPU_MLA"), ("drafter", "MLA", "CPU_MLA")], item.line()
        assert "drafter MLA -> CPU_MLA" in item.line(), item.line()

    llama = cpu("cpu-llama-planned")  # CPU_MLA asked for a Llama drafter: the CPU gives it CPU_ATTN
    with pytest.raises(BadInput) as refusal:
        check_engines(llama, (6,), show=False)
    assert "No common block size for 16 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])" in str(refusal.value)


def test_on_the_gpu_host_the_planned_mla_drafter_takes_cudas_mla_backend(standin):
    """The same plan under CUDA's selector at the GPU host's sm_120: the MLA drafter's layers ask for an MLA
    backend, so the Kimi config's TRITON_ATTN (for its Llama-shaped drafter) is refused and TRITON_MLA taken."""
    from eagle_pipeline.plan.rehearsal import check_engines

    with pytest.raises(BadInput) as refusal:
        check_engines(kimi_config(standin, "cuda-mla-attn", train=MLA_TRAIN), (5,), show=False)
    assert "serve.drafter_attention_backend" in str(refusal.value), refusal.value
    cfg = kimi_config(standin, "cuda-mla", train=MLA_TRAIN, serve={"drafter_attention_backend": "TRITON_MLA"})
    (done,) = check_engines(cfg, (5,), show=False)
    assert CUDA in done.line() and "drafter MLA -> TRITON_MLA" in done.line(), done.line()


def test_the_mla_fine_tune_configs_servers_are_accepted_by_cudas_selector(standin):
    """configs/kimi-k2.5-10k-finetune-mla.yaml on the stand-in (its settings that the stand-in cannot take fitted as
    for the other Kimi configs, its drafter planned from the target): every stage 05 and 06 engine, its engine
    variants included, gets MLA backends CUDA accepts for target and drafter."""
    from eagle_pipeline.plan.rehearsal import check_engines

    path = standin / "mla-finetune.yaml"
    path.write_text(yaml.safe_dump({
        "extends": str(REPO / "configs" / "kimi-k2.5-10k-finetune-mla.yaml"), "run_name": "mla-finetune",
        "data_root": str(standin / "data"), **STANDIN_FIT, "train": {**MLA_TRAIN, "init_from": None},
        "vocab": {"draft_vocab_size": 49152}, "verifier": {"path": str(standin / "kimi"), **VERIFIER_FIT}}))
    done = check_engines(load_config(path, []), (5, 6), show=False)  # a refusal would raise BadInput
    assert len(done) == 8, [item.line() for item in done]  # load check; none, eagle3, schedule, 3 variants, capture
    drafted = [item for item in done if len(item.result.layers) == 2]
    assert len(drafted) == 6 and all(CUDA in item.line() and "target MLA -> TRITON_MLA" in item.line()
                                     and "drafter MLA -> TRITON_MLA" in item.line() for item in drafted), \
        [item.line() for item in done]


def test_the_one_pass_configs_answering_engine_captures_and_is_accepted_by_cudas_selector(standin):
    """configs/kimi-k2.5-10k-one-pass.yaml on the stand-in: stage 01's answering engine carries the capture's
    speculative method and connector (vLLM's default V2 runner: async scheduling as vLLM sets it; on the V1 runner off,
    vLLM #56417) and gets the MLA backend CUDA accepts; stage 02 starts no engine."""
    from eagle_pipeline.plan.rehearsal import check_engines, planned_engines

    path = standin / "one-pass.yaml"
    path.write_text(yaml.safe_dump({
        "extends": str(REPO / "configs" / "kimi-k2.5-10k-one-pass.yaml"), "run_name": "one-pass",
        "data_root": str(standin / "data"), **STANDIN_FIT, "verifier": {"path": str(standin / "kimi"), **VERIFIER_FIT}}))
    cfg = load_config(path, [])
    (done,) = check_engines(cfg, (1, 2), show=False)  # a refusal would raise BadInput
    assert done.engine.name == "answering engine" and CUDA in done.line() and "target MLA -> TRITON_MLA" in done.line()
    args = done.engine.engine_args
    assert args["speculative_config"]["method"] == "extract_hidden_states" and "async_scheduling" not in args
    assert args["kv_transfer_config"]["kv_connector"] == "ExampleHiddenStatesConnector"
    v1 = load_config(path, ["verifier.model_runner=v1"])
    (engine,) = planned_engines(v1, 1, standin / "scratch")
    assert engine.engine_args["async_scheduling"] is False


def test_the_dflash_fine_tune_configs_servers_are_accepted_by_cudas_selector(standin):
    """configs/kimi-k2.5-10k-finetune-dflash.yaml on the stand-in (its settings fitted as for the other Kimi configs,
    the release left out: its drafter planned from the target): stage 05's load check and stage 06's drafter serve
    method dflash, whose drafter CUDA's selector gives a backend with non-causal attention beside TRITON_MLA."""
    from eagle_pipeline.plan.rehearsal import check_engines

    path = standin / "dflash-finetune.yaml"
    path.write_text(yaml.safe_dump({
        "extends": str(REPO / "configs" / "kimi-k2.5-10k-finetune-dflash.yaml"), "run_name": "dflash-finetune",
        "data_root": str(standin / "data"), **STANDIN_FIT,
        "train": {"draft_shape": None, "init_from": None, "dflash": {"num_layers": 1, "mask_token_id": None}},
        "vocab": {"draft_vocab_size": 49152}, "verifier": {"path": str(standin / "kimi"), **VERIFIER_FIT}}))
    cfg = load_config(path, [])
    assert cfg.train.family == "dflash"
    done = check_engines(cfg, (5, 6), show=False)  # a refusal would raise BadInput
    lines = [item.line() for item in done]
    assert any("server dflash:" in line for line in lines), lines
    drafted = [line for line in lines if "drafter" in line.split(":", 1)[1]]
    assert len(drafted) == 7 and all(CUDA in line and "target MLA -> TRITON_MLA" in line and re.search(
        r"drafter full attention -> (TRITON_ATTN|FLASH_ATTN);", line) for line in drafted), lines
