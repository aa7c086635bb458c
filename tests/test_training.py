"""eagle_pipeline.train: speculators' own trainer on tiny synthetic verifiers, on the CPU.

The verifiers are small random models saved as HF folders without a tokenizer; their hidden states are
captured with HF transformers in speculators' offline format (stage 02's output format).
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from eagle_pipeline.config import load_section
from eagle_pipeline.errors import BadInput
from eagle_pipeline.train import checkpoints, launch, runner
from eagle_pipeline.train.settings import TrainRun

REPO = Path(__file__).resolve().parent.parent
VOCAB = 512
HIDDEN = 64
LAYER_IDS = [1, 2, 3]


@dataclass
class Case:
    verifier: Path
    data: Path
    d2t: Path
    t2d: Path

    def paths(self, out: Path, **overrides) -> dict:
        paths = dict(data_dir=self.data, d2t_path=self.d2t, t2d_path=self.t2d, verifier_dir=self.verifier, out_dir=out)
        return {**paths, **overrides}

    def run(self, out: Path, **overrides) -> TrainRun:
        """Where a run on this case reads and writes, on the CPU."""
        return TrainRun(**{**RUN, **self.paths(out), **overrides})


# Small and fast: ~8 packed 256-token steps per epoch. One thread: the models are too small to gain from
# two, and on a busy machine a second thread mostly waits.
FAST = dict(total_seq_len=256, lr=1e-3, num_workers=0, keep_last=1, val_ratio=0.1, threads=1, dtype="float32")
RUN = dict(layer_ids=LAYER_IDS, seed=0, storage_dtype="bfloat16", device="cpu")


def settings(**values):
    """FAST train settings with `values` on top, validated as the run config's train section is."""
    return load_section("train", {**FAST, **values}, source="test settings")


def write_training_data(model, final_norm, data_dir: Path, lengths: list[int], seed: int) -> None:
    """Hidden states of LAYER_IDS plus the final layer before its norm, as stage 02 stores them."""
    from datasets import Dataset
    from safetensors.torch import save_file

    captured = {}
    hook = final_norm.register_forward_pre_hook(lambda module, args: captured.update(pre_norm=args[0]))
    generator = torch.Generator().manual_seed(seed)
    rows = {"input_ids": [], "loss_mask": [], "seq_len": []}
    (data_dir / "hidden_states").mkdir(parents=True)
    for row, length in enumerate(lengths):
        token_ids = torch.randint(0, VOCAB, (length,), generator=generator)
        with torch.no_grad():
            out = model(token_ids[None], output_hidden_states=True)
        layers = [out.hidden_states[k][0] for k in LAYER_IDS] + [captured["pre_norm"][0]]
        hidden_states = torch.stack(layers, dim=1).to(torch.bfloat16).contiguous()
        save_file({"hidden_states": hidden_states, "token_ids": token_ids},
                  str(data_dir / "hidden_states" / f"hs_{row}.safetensors"))
        loss_mask = [0] * (length // 3) + [1] * (length - length // 3)  # the "assistant" part
        rows["input_ids"].append(token_ids.tolist())
        rows["loss_mask"].append(loss_mask)
        rows["seq_len"].append(length)
    hook.remove()
    dataset = Dataset.from_dict(rows)
    dataset.set_format("torch")
    dataset.save_to_disk(str(data_dir))


def write_vocab_map(folder: Path, token_ids: np.ndarray, name: str = "") -> tuple[Path, Path]:
    token_ids = np.sort(token_ids)
    d2t = (token_ids - np.arange(len(token_ids))).astype(np.int64)
    t2d = np.zeros(VOCAB, dtype=bool)
    t2d[token_ids] = True
    np.save(folder / f"d2t{name}.npy", d2t)
    np.save(folder / f"t2d{name}.npy", t2d)
    return folder / f"d2t{name}.npy", folder / f"t2d{name}.npy"


@pytest.fixture(scope="module")
def llama_case(tmp_path_factory) -> Case:
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("llama_case")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(root / "verifier")
    lengths = torch.randint(40, 100, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    write_training_data(model, model.model.norm, root / "data", lengths, seed=2)
    d2t, t2d = write_vocab_map(root, np.arange(0, VOCAB, 4))
    return Case(root / "verifier", root / "data", d2t, t2d)


@pytest.fixture(scope="module")
def trained(llama_case, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("trained") / "04_train"
    summary = runner.train_drafter(settings(epochs=3), llama_case.run(out))
    return {"out": out, "summary": summary, "data": llama_case.data}


def read_rows(out: Path) -> list[dict]:
    with open(out / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_training_writes_checkpoints_metrics_plot_and_best(trained):
    out, summary = trained["out"], trained["summary"]
    rows = read_rows(out)
    train_rows = [r for r in rows if r["split"] == "train"]
    val_rows = [r for r in rows if r["split"] == "val"]

    # One optimizer step per train row, numbered 1..N; one validation per epoch.
    steps = [int(r["step"]) for r in train_rows]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 6
    assert [int(r["epoch"]) for r in val_rows] == [0, 1, 2]
    for key in ("loss", "full_acc_0", "full_acc_2", "cond_acc_0", "cond_acc_2"):
        assert all(r[key] != "" for r in train_rows + val_rows), key
    assert all(0.0 <= float(r["full_acc_1"]) <= 1.0 for r in train_rows)
    # It learns: validation loss falls.
    assert float(val_rows[-1]["loss"]) < float(val_rows[0]["loss"])

    # Each checkpoint is replayed on the held-out conversations as the engine would serve it, and the best
    # is the one predicted to have the longest accepted chains (the lower loss on ties).
    predicted = {int(r["epoch"]): float(r["predicted_acceptance_length"]) for r in val_rows}
    assert all(1.0 <= length <= 4.0 for length in predicted.values()), predicted
    assert all(r["predicted_acceptance_length"] == "" for r in train_rows)
    val_loss = {int(r["epoch"]): float(r["loss"]) for r in val_rows}
    best_epoch = min(val_loss, key=lambda e: (-predicted[e], val_loss[e], e))
    best = json.loads((out / "best.json").read_text())
    assert best["epoch"] == best_epoch and best["val_loss"] == pytest.approx(val_loss[best_epoch])
    assert best["selected_by"] == "predicted_acceptance" and best["predicted_acceptance_length"] == predicted[best_epoch]
    assert sorted(checkpoints.complete_checkpoints(out / "checkpoints")) == sorted({2, best_epoch})
    assert (out / best["checkpoint"] / "model.safetensors").is_file()
    assert summary["last"] == {"epoch": 2, "step": steps[-1], "checkpoint": "checkpoints/2"}
    assert summary["best"] == best and summary["epochs_completed"] == 3

    # The figure is the replay of that very checkpoint on the first validation rows of the split.
    from eagle_pipeline.predict.acceptance import predict_acceptance
    from eagle_pipeline.train.predicted_acceptance import validation_conversations

    conversations = validation_conversations(trained["data"], out, limit=16)
    split = json.loads((out / "split.json").read_text())
    assert len(conversations) == len(split["val_rows"]) >= 1
    replayed = predict_acceptance(out / "checkpoints" / "2", conversations, 3)["predicted_mean_acceptance_length"]
    assert predicted[2] == pytest.approx(replayed, abs=1e-4)
    validation = json.loads((out / "checkpoints" / "2" / "validation.json").read_text())
    assert validation["predicted_conversations"] == len(conversations) and len(validation["predicted_per_position_acceptance"]) == 3

    png = (out / "loss_curves.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    assert list((out / "tensorboard").rglob("events.out.tfevents.*"))

    assert summary["train_tokens_per_s"] > 0 and summary["peak_rss_mb"] > 100
    assert summary["this_run"]["steps"] == len(steps) and summary["this_run"]["resumed_from"] is None

    # The drafter speculators trained: derived from the verifier, full attention, with the vocab map.
    config = json.loads((out / "checkpoints/2/config.json").read_text())
    assert config["transformer_layer_config"]["layer_types"] == ["full_attention"]
    assert config["eagle_aux_hidden_state_layer_ids"] == LAYER_IDS
    assert config["draft_vocab_size"] == VOCAB // 4
    assert (config["norm_before_residual"], config["norm_before_fc"], config["fc_norm"], config["norm_output"]) == (
        True, True, False, True)


def test_rerun_of_a_finished_run_trains_nothing(trained, llama_case):
    out = trained["out"]
    before = (out / "metrics.csv").read_text()
    summary = runner.train_drafter(settings(epochs=3), llama_case.run(out))
    assert (out / "metrics.csv").read_text() == before
    assert summary["last"] == trained["summary"]["last"]


RUN_IN_SUBPROCESS = """
import json, sys
from eagle_pipeline.config import TrainConfig
from eagle_pipeline.train.runner import train_drafter
from eagle_pipeline.train.settings import TrainRun
arguments = json.loads(sys.argv[1])
train_drafter(TrainConfig(**arguments["train"]), TrainRun(**arguments["run"]))
"""


def test_killed_run_resumes_from_the_last_complete_checkpoint(llama_case, trained, tmp_path):
    out = tmp_path / "04_train"
    arguments = {"train": settings(epochs=3).model_dump(mode="json"), "run": llama_case.run(out).to_json()}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    log = open(tmp_path / "killed_run.log", "w")
    process = subprocess.Popen([sys.executable, "-c", RUN_IN_SUBPROCESS, json.dumps(arguments)],
                               cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    first_checkpoint = out / "checkpoints" / "0" / checkpoints.COMPLETE_MARKER
    deadline = time.monotonic() + 240
    try:
        while not first_checkpoint.exists():
            assert process.poll() is None, (tmp_path / "killed_run.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 240 s"
            time.sleep(0.02)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
        log.close()

    complete = checkpoints.complete_checkpoints(out / "checkpoints")
    assert 0 in complete and max(complete) < 2, "the kill should land before the run finished"
    resume_from = complete[max(complete)]
    # A kill while speculators writes the next checkpoint leaves a folder like this one; speculators
    # itself would resume from it (the highest number) and fail to load it.
    torn = out / "checkpoints" / str(max(complete) + 1)
    torn.mkdir(exist_ok=True)
    (torn / "config.json").write_text("{}")
    (torn / "model.safetensors").write_bytes(b"\0" * 64)
    # A stop (SIGTERM) makes speculators save the epoch in progress as `interrupted/`, which a SIGKILL after the
    # stop's grace may tear; the pipeline resumes from complete epochs only and removes it.
    interrupted = out / "checkpoints" / checkpoints.INTERRUPTED_DIR
    interrupted.mkdir()
    (interrupted / "model.safetensors").write_bytes(b"\0" * 64)

    summary = runner.train_drafter(settings(epochs=3), llama_case.run(out))
    assert not interrupted.exists()

    assert summary["this_run"]["resumed_from"] == {"epoch": resume_from["epoch"], "step": resume_from["global_step"]}
    total_steps = trained["summary"]["last"]["step"]  # the same run, never interrupted
    assert summary["last"]["step"] == total_steps
    assert summary["this_run"]["steps"] == total_steps - resume_from["global_step"]
    rows = read_rows(out)
    # Rows the killed run logged after its checkpoint were dropped and logged again once.
    assert [int(r["step"]) for r in rows if r["split"] == "train"] == list(range(1, total_steps + 1))
    assert [int(r["epoch"]) for r in rows if r["split"] == "val"] == [0, 1, 2]


def test_max_steps_stops_training_across_epochs(llama_case, tmp_path):
    out = tmp_path / "04_train"
    summary = runner.train_drafter(settings(epochs=3), llama_case.run(out, max_steps=3))
    # speculators alone would go on to train one step in each remaining epoch.
    complete = checkpoints.complete_checkpoints(out / "checkpoints")
    assert list(complete) == [0] and complete[0]["global_step"] == 3
    assert summary["this_run"]["steps"] == 3


def test_best_fit_packing_trains_an_epoch_in_fewer_steps(trained, llama_case, tmp_path):
    out = tmp_path / "04_train"
    runner.train_drafter(settings(epochs=1, packing="best_fit"), llama_case.run(out))
    best_fit_steps = [r for r in read_rows(out) if r["split"] == "train"]
    sequential_steps = [r for r in read_rows(trained["out"]) if r["split"] == "train" and r["epoch"] == "0"]
    # The same epoch-0 shuffle of the same rows, packed tighter into the same 256-token batches.
    assert 0 < len(best_fit_steps) < len(sequential_steps)
    assert all(np.isfinite(float(r["loss"])) for r in best_fit_steps)


def test_training_without_the_padding_takes_the_same_steps(llama_case, tmp_path, monkeypatch):
    from patches import speculators_packing

    losses = {}
    for name in ("trimmed", "padded"):
        if name == "padded":
            monkeypatch.setattr(speculators_packing, "trim_padding", lambda batch: batch)
        out = tmp_path / name / "04_train"
        runner.train_drafter(settings(epochs=1), llama_case.run(out, max_steps=3))
        losses[name] = [float(r["loss"]) for r in read_rows(out) if r["split"] == "train"]
    # Padding is masked out of attention and loss: leaving it out changes no step's loss (and so no update).
    assert len(losses["trimmed"]) == 3
    assert losses["trimmed"] == pytest.approx(losses["padded"], rel=1e-4)


def test_init_from_fine_tunes_a_trained_drafter(trained, llama_case, tmp_path):
    best = trained["out"] / trained["summary"]["best"]["checkpoint"]
    out = tmp_path / "04_train"
    runner.train_drafter(settings(init_from=str(best), epochs=1), llama_case.run(out, max_steps=2))
    first_loss_fresh = float(read_rows(trained["out"])[0]["loss"])
    first_loss_tuned = float(read_rows(out)[0]["loss"])
    assert first_loss_tuned < 0.9 * first_loss_fresh


def test_init_from_with_another_vocab_map_is_refused(trained, llama_case, tmp_path):
    best = trained["out"] / trained["summary"]["best"]["checkpoint"]
    other_ids = np.arange(0, VOCAB, 4)
    other_ids[5] += 1
    d2t, t2d = write_vocab_map(tmp_path, other_ids, name="_other")
    with pytest.raises(BadInput, match=r"maps 1 of 128 draft ids to other target tokens"):
        runner.train_drafter(settings(init_from=str(best), epochs=1),
                             llama_case.run(tmp_path / "a", d2t_path=d2t, t2d_path=t2d))

    d2t, t2d = write_vocab_map(tmp_path, np.arange(0, VOCAB, 8), name="_small")
    with pytest.raises(BadInput, match=r"draft vocabulary has 128 tokens, this run's .* has 64"):
        runner.train_drafter(settings(init_from=str(best), epochs=1),
                             llama_case.run(tmp_path / "b", d2t_path=d2t, t2d_path=t2d))

    other_shape = {"num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16, "intermediate_size": 96}
    with pytest.raises(BadInput, match=r"another drafter shape .*intermediate_size 128 vs 96"):
        runner.train_drafter(settings(init_from=str(best), draft_shape=other_shape, epochs=1),
                             llama_case.run(tmp_path / "c"))


def test_bad_training_inputs_are_named(llama_case, tmp_path):
    from datasets import load_from_disk

    with pytest.raises(BadInput, match=r"hidden_states has shape \[\d+, 4, 64\], expected \[seq, 3, 64\]"):
        runner.train_drafter(settings(), llama_case.run(tmp_path / "a", layer_ids=[1, 3]))

    plain = load_from_disk(str(llama_case.data)).with_format(None)
    plain.save_to_disk(str(tmp_path / "plain"))
    shutil.copytree(llama_case.data / "hidden_states", tmp_path / "plain" / "hidden_states")
    with pytest.raises(BadInput, match=r"torch format"):
        runner.train_drafter(settings(), llama_case.run(tmp_path / "b", data_dir=tmp_path / "plain"))

    with pytest.raises(BadInput, match=r"train.draft_shape: missing keys \['head_dim'\]"):
        runner.train_drafter(settings(draft_shape={"num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 8}),
                             llama_case.run(tmp_path / "c"))


def test_torchrun_command_runs_the_launch_module_on_every_rank(llama_case, tmp_path):
    out = tmp_path / "04_train"
    command = launch.torchrun_command(settings(epochs=2, num_gpus=8), llama_case.run(out, device="cuda"))
    assert command[:5] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=8"]
    # torchrun gives its ranks the stop's grace period before it kills them (eagle_pipeline/train/stop.py).
    assert command[5:] == [f"--shutdown-timeout={launch.STOP_GRACE_S}", "-m", "eagle_pipeline.train.launch",
                           str(out / "launch.json")]
    train, run = launch.read_launch_file(out / "launch.json")
    assert run.device == "cuda" and train.epochs == 2 and run.d2t_path == llama_case.d2t.resolve()
    assert json.loads((out / "draft_config.json").read_text())["layer_types"] == ["full_attention"]
    argv = runner.speculators_argv(train, run)
    assert argv[argv.index("--draft-attn-impl") + 1] == "simple_flex_attention"
    assert argv[argv.index("--loss-implementation") + 1] == "fused"
    assert "--fsdp-shard" not in argv
    assert "--fsdp-shard" in runner.speculators_argv(settings(num_gpus=8, fsdp_shard=True), run)

    with pytest.raises(BadInput, match=r"train.fsdp_shard: needs GPUs"):
        settings(fsdp_shard=True)


def test_torchrun_command_on_the_cpu_needs_a_process_count(llama_case, tmp_path):
    with pytest.raises(BadInput, match=r"multi-GPU runs train on 'cuda'"):
        launch.torchrun_command(settings(), llama_case.run(tmp_path / "a"))
    command = launch.torchrun_command(settings(), llama_case.run(tmp_path / "b"), num_processes=2)
    assert command[4] == "--nproc_per_node=2"
    with pytest.raises(ValueError, match=r"num_processes is for CPU runs"):
        launch.torchrun_command(settings(num_gpus=8), llama_case.run(tmp_path / "c", device="cuda"), num_processes=2)


@pytest.mark.slow
@pytest.mark.parametrize("fsdp_shard", [False, True], ids=["replicated", "fsdp"])
def test_launcher_trains_with_two_cpu_processes(llama_case, trained, tmp_path, fsdp_shard):
    from safetensors.torch import load_file

    out = tmp_path / "04_train"
    # The config only allows fsdp_shard with num_gpus set; the run's device decides where it trains.
    # Early stopping on predicted acceptance: rank 0 replays the checkpoint and sends the figure to rank 1.
    train = settings(epochs=1, num_gpus=2 if fsdp_shard else 0, fsdp_shard=fsdp_shard, early_stop_patience=1)
    run = llama_case.run(out, max_steps=3)
    command = launch.torchrun_command(train, run, num_processes=2)
    # COLUMNS: speculators' console log wraps its lines at the terminal width.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "COLUMNS": "300"}
    log_path = tmp_path / "torchrun.log"
    with open(log_path, "w") as log:
        result = subprocess.run(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=600)
    log_text = log_path.read_text()
    assert result.returncode == 0, log_text[-5000:]
    # Both ranks joined one gloo process group (patches/speculators_cpu.py).
    for local_rank in (0, 1):
        assert f"Started distributed (gloo) with local_rank={local_rank}, dp_size=2" in log_text

    summary = runner.finalize_training(train, run)
    assert summary["epochs_completed"] == 1 and summary["last"] == {"epoch": 0, "step": 3, "checkpoint": "checkpoints/0"}
    assert summary["best"]["epoch"] == 0 and summary["this_run"]["world_size"] == 2
    assert summary["best"]["selected_by"] == "predicted_acceptance" and summary["best"]["predicted_acceptance_length"] >= 1
    assert ("--fsdp-shard" in summary["this_run"]["argv"]) == fsdp_shard
    # The checkpoint holds what a single-process run's does.
    single = trained["out"] / trained["summary"]["last"]["checkpoint"]
    assert sorted(p.name for p in (out / "checkpoints/0").iterdir()) == sorted(p.name for p in single.iterdir())
    assert list(checkpoints.complete_checkpoints(out / "checkpoints")) == [0]
    tensors, single_tensors = load_file(str(out / "checkpoints/0/model.safetensors")), load_file(str(single / "model.safetensors"))
    assert {k: v.shape for k, v in tensors.items()} == {k: v.shape for k, v in single_tensors.items()}
    # Only rank 0 records metrics: every step once, one validation.
    rows = read_rows(out)
    assert list(rows[0]) == list(read_rows(trained["out"])[0])
    assert [int(r["step"]) for r in rows if r["split"] == "train"] == [1, 2, 3]
    assert [int(r["epoch"]) for r in rows if r["split"] == "val"] == [0]
    assert all(np.isfinite(float(r["loss"])) for r in rows)


def make_kimi_k25_verifier(folder: Path):
    """A tiny DeepSeek-V3 (MLA + MoE) text model inside a Kimi-K2.5 config, weights under Kimi's names."""
    from safetensors.torch import save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    text = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
        first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1,
        topk_group=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=512, rope_theta=50000.0,
        tie_word_embeddings=False,
    )
    model = DeepseekV3ForCausalLM(text).eval()
    folder.mkdir(parents=True)
    # Kimi-K2.5's checkpoint nests the text model under language_model. and ships a vision tower.
    weights = {f"language_model.{name}": tensor.contiguous() for name, tensor in model.state_dict().items()}
    weights["vision_tower.encoder.final_layernorm.weight"] = torch.full((32,), 7.0)
    weights["mm_projector.pre_norm.weight"] = torch.full((32,), 7.0)
    save_file(weights, str(folder / "model.safetensors"))
    text_config = {**text.to_dict(), "model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"]}
    config = {
        "model_type": "kimi_k25",
        "architectures": ["KimiK25ForConditionalGeneration"],
        "text_config": text_config,
        "vision_config": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                          "intermediate_size": 64},
    }
    (folder / "config.json").write_text(json.dumps(config))
    return model, weights


def test_kimi_k25_nested_verifier_trains_a_head_dim_128_drafter(tmp_path):
    from safetensors.torch import load_file
    from speculators.utils.loading import load_model_layers

    model, weights = make_kimi_k25_verifier(tmp_path / "kimi")
    write_training_data(model, model.model.norm, tmp_path / "data", [48] * 12, seed=3)
    d2t, t2d = write_vocab_map(tmp_path, np.arange(0, VOCAB, 4))

    # speculators finds the verifier's embeddings, lm_head and final norm under the nested names.
    found = load_model_layers(["embed_tokens.weight", "lm_head.weight", "model.norm.weight"], str(tmp_path / "kimi"))
    assert torch.equal(found["embed_tokens.weight"], weights["language_model.model.embed_tokens.weight"])
    assert torch.equal(found["lm_head.weight"], weights["language_model.lm_head.weight"])
    assert torch.equal(found["model.norm.weight"], weights["language_model.model.norm.weight"])

    shape = {"num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 96,
             "rope_theta": 1e6, "num_hidden_layers": 1}
    out = tmp_path / "04_train"
    summary = runner.train_drafter(
        settings(draft_shape=shape, epochs=1, total_seq_len=128, val_ratio=0.25),
        TrainRun(data_dir=tmp_path / "data", d2t_path=d2t, t2d_path=t2d, verifier_dir=tmp_path / "kimi", out_dir=out,
                 **RUN),
    )

    train_rows = [r for r in read_rows(out) if r["split"] == "train"]
    assert len(train_rows) >= 3 and all(np.isfinite(float(r["loss"])) for r in train_rows)
    checkpoint = out / summary["last"]["checkpoint"]
    layer = json.loads((checkpoint / "config.json").read_text())["transformer_layer_config"]
    assert (layer["head_dim"], layer["num_attention_heads"], layer["layer_types"]) == (128, 4, ["full_attention"])
    assert layer["rope_parameters"]["rope_theta"] == 1e6
    tensors = load_file(str(checkpoint / "model.safetensors"))
    assert tensors["layers.0.self_attn.q_proj.weight"].shape == (4 * 128, 2 * HIDDEN)  # [embeds, fc(aux)] input
    assert tensors["layers.0.self_attn.o_proj.weight"].shape == (HIDDEN, 4 * 128)
    assert torch.equal(tensors["embed_tokens.weight"],
                       weights["language_model.model.embed_tokens.weight"].to(torch.bfloat16))


def test_loss_decay_reaches_speculators_config(llama_case, tmp_path):
    from speculators.train.config import TrainConfig

    train, run = settings(ttt_step_loss_decay=0.8), llama_case.run(tmp_path / "04_train")
    runner.prepare(train, run)
    resolved = TrainConfig.resolve(runner.speculators_argv(train, run))
    assert resolved.model_dump_json().count('"ttt_step_loss_decay":0.8') == 1

    with pytest.raises(BadInput, match=r"train.ttt_step_loss_decay: Input should be less than or equal to 1 \(got 1.5\)"):
        runner.train_drafter(settings(ttt_step_loss_decay=1.5), llama_case.run(tmp_path / "b"))


def test_a_loss_that_is_not_finite_stops_training_with_an_error_keeping_no_bad_checkpoint(trained, llama_case, tmp_path):
    from safetensors.torch import load_file, save_file

    from eagle_pipeline.train.finite_guard import STOPPED_FILE, NonFiniteLoss

    source = trained["out"] / trained["summary"]["last"]["checkpoint"]
    poisoned = tmp_path / "poisoned"
    shutil.copytree(source, poisoned)
    weights = load_file(str(poisoned / "model.safetensors"))
    weights = {name: torch.full_like(t, float("nan")) if t.is_floating_point() and "embed" not in name else t
               for name, t in weights.items()}
    save_file(weights, str(poisoned / "model.safetensors"))
    out = tmp_path / "04_train"
    with pytest.raises(NonFiniteLoss, match=r"train\.loss: not finite \(nan\) for 3 steps in a row.*train\.init_from"):
        runner.train_drafter(settings(epochs=2, init_from=str(poisoned)), llama_case.run(out))
    assert "not finite" in json.loads((out / STOPPED_FILE).read_text())["reason"]
    assert checkpoints.complete_checkpoints(out / "checkpoints") == {}
    # Three steps, not an epoch: it stopped at the third (whose row the guard, first in line, kept out).
    assert len([r for r in read_rows(out) if r["split"] == "train"]) == 2
