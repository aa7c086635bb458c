"""Hidden-state capture: vLLM's layer convention, speculators' loader, fp8 storage, sample checks, CPU patch.

The vLLM-marked tests share one engine run (a subprocess through `python -m eagle_pipeline.capture`), with the
engine in that process as engine.in_process_engine has it for one CPU worker; the Kimi stand-in's capture
(tests/test_kimi_vllm.py, given engine processes) checks the path a GPU host takes against HF the same way. It
runs eagerly (`enforce_eager`): torch.compile adds one to three minutes of start-up on this machine and does
not change which states are captured.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import skip_without_bf16_matmul
from safetensors.torch import save_file

from eagle_pipeline.capture import kv_transfer_config, speculative_config
from eagle_pipeline.errors import BadInput
from eagle_pipeline.layer_ids import capture_layer_ids as vllm_layer_ids
from eagle_pipeline.samples import BadSample, read_sample, sample_filename, verify_sample_file, write_sample

REPO_ROOT = Path(__file__).resolve().parent.parent
AUX_IDS = [2, 15, 27]
NUM_LAYERS = 30
HIDDEN = 576
# Tolerance: mean over tokens of the per-token relative L2 error, vLLM bf16 capture vs HF transformers fp32.
# Measured on SmolLM2-135M (eager): ids 2/15/27 0.5%/1.2%/1.6%, final pre-norm slot 2.2%. The neighbouring
# layers are >= 23% away, so 3% tells the right layer from an off-by-one.
CAPTURE_TOLERANCE = 0.03
NEIGHBOUR_MIN_DISTANCE = 0.15
# fp8 e4m3 keeps 3 mantissa bits, one scale per token: measured 2.3-2.7% per slot (4.2% worst token).
FP8_TOLERANCE = 0.04


def relative_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """Mean over tokens (dim 0) of |actual - reference| / |reference|, norms over the hidden dim."""
    actual, reference = actual.float(), reference.float()
    return float(((actual - reference).norm(dim=-1) / reference.norm(dim=-1)).mean())


# ---------------------------------------------------------------- fast tests: ids, configs, checks


def test_vllm_ids_append_the_final_layer():
    assert vllm_layer_ids([2, 15, 27], 30) == [2, 15, 27, 30]
    config = speculative_config([2, 15, 27], 30)
    assert config["method"] == "extract_hidden_states"
    assert config["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27, 30]


@pytest.mark.parametrize("ids", [[15, 2, 27], [2, 2, 27], [2, 15, 30], [-1, 15], [], [2.0, 15]])
def test_vllm_ids_reject_ids_vllm_would_reorder_merge_or_miss(ids):
    with pytest.raises(BadInput, match="layer_ids"):
        vllm_layer_ids(ids, 30)


def test_connector_is_picked_by_device(tmp_path):
    cpu = kv_transfer_config(tmp_path, "cpu")
    assert cpu["kv_connector"] == "CpuHiddenStatesConnector"
    assert cpu["kv_connector_module_path"] == "patches.cpu_hidden_states_connector"
    cuda = kv_transfer_config(tmp_path, "cuda")
    assert cuda["kv_connector"] == "ExampleHiddenStatesConnector"
    assert "kv_connector_module_path" not in cuda
    assert cpu["kv_connector_extra_config"]["shared_storage_path"] == str(tmp_path)


def synthetic_sample(seq: int = 7, slots: int = 4, hidden: int = 16) -> tuple[dict, list[int]]:
    tokens = list(range(100, 100 + seq))
    sample = {
        "hidden_states": torch.randn(seq, slots, hidden, generator=torch.Generator().manual_seed(0)).bfloat16(),
        "token_ids": torch.tensor(tokens),
    }
    return sample, tokens


def test_written_sample_round_trips(tmp_path):
    sample, tokens = synthetic_sample()
    path = write_sample(tmp_path, 5, sample, tokens, num_states=4, hidden_size=16)
    assert path == tmp_path / "hs_5.safetensors"
    back = read_sample(path)
    assert back["hidden_states"].dtype == torch.bfloat16 and back["token_ids"].dtype == torch.int64
    assert torch.equal(back["hidden_states"], sample["hidden_states"])
    assert torch.equal(back["token_ids"], sample["token_ids"])
    verify_sample_file(path, tokens, num_states=4, hidden_size=16)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hs_5.safetensors"]  # no temporaries left


def test_checker_rejects_nan_before_writing(tmp_path):
    sample, tokens = synthetic_sample()
    sample["hidden_states"][3, 1, 0] = float("nan")
    with pytest.raises(BadSample, match=r"hs_0\.safetensors.*NaN"):
        write_sample(tmp_path, 0, sample, tokens, num_states=4)
    assert list(tmp_path.iterdir()) == []


def test_checker_rejects_wrong_tokens_naming_file_and_position(tmp_path):
    sample, tokens = synthetic_sample()
    sample["token_ids"][4] = 7
    with pytest.raises(BadSample, match=r"hs_1\.safetensors: token ids differ from the input at position 4"):
        write_sample(tmp_path, 1, sample, tokens, num_states=4)
    with pytest.raises(BadSample, match="token ids"):
        write_sample(tmp_path, 1, synthetic_sample()[0], tokens[:-1], num_states=4)


def test_checker_rejects_wrong_slot_count(tmp_path):
    sample, tokens = synthetic_sample(slots=3)
    with pytest.raises(BadSample, match="3 hidden-state slots, expected 4"):
        write_sample(tmp_path, 0, sample, tokens, num_states=4)


def test_checker_rejects_stored_files_that_are_torn_or_poisoned(tmp_path):
    sample, tokens = synthetic_sample()
    torn = write_sample(tmp_path, 0, sample, tokens, num_states=4)
    torn.write_bytes(torn.read_bytes()[:-100])
    with pytest.raises(BadSample, match=r"hs_0\.safetensors: unreadable"):
        verify_sample_file(torn, tokens, num_states=4)

    poisoned = dict(sample, hidden_states=sample["hidden_states"].clone())
    poisoned["hidden_states"][0, 0, 0] = float("inf")
    save_file(poisoned, str(tmp_path / "hs_1.safetensors"))
    with pytest.raises(BadSample, match=r"hs_1\.safetensors: hidden_states contain NaN or infinite"):
        verify_sample_file(tmp_path / "hs_1.safetensors", tokens, num_states=4)

    write_sample(tmp_path, 2, sample, tokens, num_states=4)
    with pytest.raises(BadSample, match=r"hs_2\.safetensors: token ids differ"):
        verify_sample_file(tmp_path / "hs_2.safetensors", [1] + tokens[1:], num_states=4)

    with pytest.raises(BadSample, match=r"hs_3\.safetensors: missing"):
        verify_sample_file(tmp_path / "hs_3.safetensors", tokens, num_states=4)


# ---------------------------------------------------------------- the CPU connector patch


def test_patch_matches_installed_upstream():
    """Fails when upstream's connector code that the patch copies or relies on changes: re-check the patch."""
    from patches import cpu_hidden_states_connector as patch
    from patches.upstream import changed_sources

    assert changed_sources(patch.UPSTREAM_SOURCE_SHA256) == []


def test_patch_refuses_other_vllm_versions(monkeypatch):
    import vllm

    from patches import cpu_hidden_states_connector as patch

    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with pytest.raises(RuntimeError, match=r"patches/cpu_hidden_states_connector\.py targets vLLM 0\.32\.0 but 0\.33\.0 is installed"):
        importlib.reload(patch)
    monkeypatch.undo()
    importlib.reload(patch)


# ---------------------------------------------------------------- one engine run for the tests below


@pytest.fixture(scope="module")
def verifier_dir() -> Path:
    from eagle_pipeline.embedded import materialize

    return materialize("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def prompts(verifier_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(verifier_dir)
    questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        # Long enough to span several KV cache blocks, so the connector gathers non-trivial slots.
        "Summarise this: " + " ".join(f"item {i} is followed by item {i + 1}." for i in range(40)),
    ]
    prompts = []
    for question in questions:
        encoded = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
        )
        prompts.append(list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded))
    assert len(prompts[2]) > 300
    return prompts


@pytest.fixture(scope="module")
def captured(tmp_path_factory, verifier_dir, prompts) -> Path:
    """Folder with hs_<i>.safetensors for `prompts`, captured by vLLM through the CPU connector."""
    skip_without_bf16_matmul()  # the capture runs the verifier in bf16 (the capture tool's default dtype)
    work = tmp_path_factory.mktemp("capture")
    (work / "prompts.json").write_text(json.dumps(prompts))
    scratch = work / "connector-scratch"
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    result = subprocess.run(
        [
            sys.executable, "-m", "eagle_pipeline.capture",
            "--verifier", str(verifier_dir),
            "--layer-ids", ",".join(map(str, AUX_IDS)),
            "--num-layers", str(NUM_LAYERS),
            "--tokens", str(work / "prompts.json"),
            "--out", str(work / "hidden_states"),
            "--max-model-len", "1024",
            "--storage-path", str(scratch),
            "--extra-engine-args", json.dumps({"enforce_eager": True}),
        ],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    # The connector's per-request files (and their .lock companions) are deleted once read.
    assert scratch.is_dir() and list(scratch.iterdir()) == []
    return work / "hidden_states"


@pytest.fixture(scope="module")
def hf_reference(verifier_dir, prompts) -> list[dict[str, torch.Tensor]]:
    """HF transformers (fp32) hidden_states per prompt, plus the final layer's output before the norm."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(verifier_dir, dtype=torch.float32).eval()
    norm_input: dict[str, torch.Tensor] = {}
    model.model.norm.register_forward_pre_hook(lambda module, args: norm_input.__setitem__("x", args[0]))
    references = []
    for ids in prompts:
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
        assert len(out.hidden_states) == NUM_LAYERS + 1
        references.append({"hidden_states": [h[0] for h in out.hidden_states], "pre_norm": norm_input["x"][0]})
    return references


@pytest.mark.vllm
@pytest.mark.slow
def test_captured_layers_match_hf_hidden_states(captured, prompts, hf_reference):
    for i, (ids, reference) in enumerate(zip(prompts, hf_reference)):
        sample = read_sample(captured / sample_filename(i))
        hidden = sample["hidden_states"]
        assert hidden.shape == (len(ids), len(AUX_IDS) + 1, HIDDEN)
        assert sample["token_ids"].tolist() == ids
        hf = reference["hidden_states"]
        for slot, layer in enumerate(AUX_IDS):
            assert relative_error(hidden[:, slot], hf[layer]) < CAPTURE_TOLERANCE, (i, layer)
            for neighbour in (layer - 1, layer + 1):
                assert relative_error(hidden[:, slot], hf[neighbour]) > NEIGHBOUR_MIN_DISTANCE, (i, layer, neighbour)
        # Last slot: the final layer's output before the norm, which is not HF's (post-norm) hidden_states[L].
        assert relative_error(hidden[:, -1], reference["pre_norm"]) < CAPTURE_TOLERANCE, i
        assert relative_error(hidden[:, -1], hf[NUM_LAYERS]) > NEIGHBOUR_MIN_DISTANCE, i


def build_speculators_data(folder: Path, prompts: list[list[int]], hidden_states_dir: Path) -> Path:
    """A dataset folder as speculators' prepare-data leaves it (torch format) plus hidden_states/."""
    from datasets import Dataset

    rows = {
        "input_ids": prompts,
        "loss_mask": [[0] * (len(ids) // 2) + [1] * (len(ids) - len(ids) // 2) for ids in prompts],
        "seq_len": [len(ids) for ids in prompts],
    }
    dataset = Dataset.from_dict(rows)
    dataset.set_format(type="torch")
    dataset.save_to_disk(str(folder))
    shutil.copytree(hidden_states_dir, folder / "hidden_states")
    return folder


@pytest.mark.vllm
@pytest.mark.slow
def test_speculators_arrow_dataset_reads_captured_samples(tmp_path, captured, prompts):
    from speculators.train.data import ArrowDataset

    data = build_speculators_data(tmp_path / "data", prompts, captured)
    dataset = ArrowDataset(1024, data, on_missing="raise")
    assert len(dataset) == len(prompts)
    for i, ids in enumerate(prompts):
        stored = read_sample(captured / sample_filename(i))["hidden_states"]
        item = dataset[i]
        assert item["input_ids"].tolist() == ids
        assert torch.equal(item["hidden_states"], stored[:, :-1].flatten(1))
        assert item["hidden_states"].shape == (len(ids), len(AUX_IDS) * HIDDEN)
        assert torch.equal(item["verifier_last_hidden_states"], stored[:, -1])
        assert item["loss_mask"].tolist() == [0] * (len(ids) // 2) + [1] * (len(ids) - len(ids) // 2)


@pytest.mark.vllm
@pytest.mark.slow
def test_fp8_storage_is_smaller_and_reads_back_through_speculators(tmp_path, captured, prompts):
    from hs_connectors import FP8Transfer
    from speculators.train.data import ArrowDataset

    fp8_dir = tmp_path / "fp8"
    for i, ids in enumerate(prompts):
        write_sample(fp8_dir, i, read_sample(captured / sample_filename(i)), ids, num_states=4, storage_dtype="fp8")
        bf16_size = (captured / sample_filename(i)).stat().st_size
        assert (fp8_dir / sample_filename(i)).stat().st_size < 0.55 * bf16_size

    data = build_speculators_data(tmp_path / "data", prompts, fp8_dir)
    # speculators' fp8 backend (--hidden-states-backend fp8) dequantizes on read.
    dataset = ArrowDataset(1024, data, transfer=FP8Transfer(data / "hidden_states"), on_missing="raise")
    for i, ids in enumerate(prompts):
        stored = read_sample(captured / sample_filename(i))["hidden_states"]
        item = dataset[i]
        assert item["input_ids"].tolist() == ids
        assert item["hidden_states"].dtype == torch.bfloat16
        assert relative_error(item["verifier_last_hidden_states"], stored[:, -1]) < FP8_TOLERANCE
        for slot in range(len(AUX_IDS)):
            restored = item["hidden_states"][:, slot * HIDDEN : (slot + 1) * HIDDEN]
            assert relative_error(restored, stored[:, slot]) < FP8_TOLERANCE
        verify_sample_file(fp8_dir / sample_filename(i), ids, num_states=4, hidden_size=HIDDEN)

    # The default file backend does not dequantize: fp8 data needs the fp8 backend in training.
    plain = ArrowDataset(1024, data, on_missing="raise")
    assert plain[0]["hidden_states"].dtype == torch.float8_e4m3fn


def test_offline_engines_run_in_the_stages_process_on_one_cpu_worker_only(tmp_path):
    from conftest import write_smoke_config

    from eagle_pipeline.config import load_config
    from eagle_pipeline.engine import MULTIPROCESSING_VARIABLE, engine_env, offline_engine_env

    config = write_smoke_config(tmp_path / "c.yaml", data_root=str(tmp_path / "d"))
    cpu = load_config(config, [])
    assert offline_engine_env(cpu)[MULTIPROCESSING_VARIABLE] == "0"
    assert MULTIPROCESSING_VARIABLE not in engine_env(cpu)  # servers and stage 05's jobs keep their processes
    parallel = load_config(config, ["verifier.tensor_parallel_size=2"])
    assert MULTIPROCESSING_VARIABLE not in offline_engine_env(parallel)  # tensor parallelism needs the workers
    own = load_config(config, ['env.VLLM_ENABLE_V1_MULTIPROCESSING="1"'])
    assert offline_engine_env(own)[MULTIPROCESSING_VARIABLE] == "1"  # the config's env wins


def test_a_server_never_inherits_the_in_process_switch(tmp_path, monkeypatch):
    from eagle_pipeline.engine import MULTIPROCESSING_VARIABLE
    from eagle_pipeline.serve.server import VllmServer

    monkeypatch.setenv(MULTIPROCESSING_VARIABLE, "0")  # set by an offline engine this process started
    assert MULTIPROCESSING_VARIABLE not in VllmServer(tmp_path, log_path=tmp_path / "s.log")._child_env()
    asked = VllmServer(tmp_path, log_path=tmp_path / "s.log", env={MULTIPROCESSING_VARIABLE: "0"})
    assert asked._child_env()[MULTIPROCESSING_VARIABLE] == "0"

