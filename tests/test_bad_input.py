"""Bad input: every case ends with exit code 2 and one `error:` line naming the field or file and the fix,
and nothing already written under the data root is lost or changed.

Earlier stages' outputs are faked (small, valid files) so that each case reaches the check it is about
without starting an engine.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO, run_stage, run_stage_in_process, stage_module, without_log_records, write_config
from released_drafter_standin import KIMI_MLA_STANDIN, KIMI_YARN, mla_standin_config

L, H, V = 30, 576, 49152  # the embedded verifier


def fake_stage(run_dir: Path, stage: str, counts: dict, inputs: dict | None = None, **extra) -> Path:
    folder = run_dir / stage
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "manifest.json").write_text(json.dumps({
        "stage": stage, "status": "complete", "inputs": inputs or {"x": "1"}, "counts": counts,
        "output_fingerprint": "f", **extra}))
    return folder


def fake_conversations(run_dir: Path) -> None:
    from datasets import Dataset

    folder = fake_stage(run_dir, "01_generate_data", {"samples": 2})
    rows = [{"sample_id": f"s{i:06d}", "prompt_id": str(i), "finish_reason": "stop", "prompt_tokens": 5, "completion_tokens": 3,
             "messages": [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": f"Answer {i}."}]}
            for i in range(2)]
    Dataset.from_list(rows).save_to_disk(str(folder / "conversations"))


def fake_hidden_states(run_dir: Path, corrupt: str | None = None) -> Path:
    from datasets import Dataset
    from safetensors.torch import save_file

    fake_conversations(run_dir)
    folder = fake_stage(run_dir, "02_extract_hidden", {"samples": 2, "target_vocab_size": V, "layer_ids": [2, 15, 27]},
                        inputs={"layer_ids": [2, 15, 27]},
                        resolved={"layer_ids": [2, 15, 27], "num_layers": 30, "num_hidden_states": 4, "hidden_size": H,
                                  "target_vocab_size": V, "storage_dtype": "bfloat16"})
    data = folder / "data"
    rows = [{"sample_id": f"s{i:06d}", "input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1], "seq_len": 4} for i in range(2)]
    Dataset.from_list(rows).with_format("torch").save_to_disk(str(data))
    (data / "hidden_states").mkdir()
    for i in range(2):
        hidden = torch.randn(4, 4, H, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)  # no flat row
        tokens = torch.tensor([1, 2, 3, 4])
        if corrupt == "nan" and i == 1:
            hidden[2, 1, 7] = float("nan")
        if corrupt == "out_of_step" and i == 1:
            tokens = torch.tensor([1, 2, 3, 9])
        save_file({"hidden_states": hidden, "token_ids": tokens}, str(data / "hidden_states" / f"hs_{i}.safetensors"))
    if corrupt == "truncated":
        path = data / "hidden_states" / "hs_1.safetensors"
        path.write_bytes(path.read_bytes()[:-100])
    if corrupt == "missing":
        (data / "hidden_states" / "hs_1.safetensors").unlink()
    return folder


def fake_vocab(run_dir: Path) -> None:
    import numpy as np

    folder = fake_stage(run_dir, "03_build_vocab_map", {"samples": 2})
    np.save(folder / "d2t.npy", np.zeros(8192, dtype=np.int64))
    np.save(folder / "t2d.npy", np.zeros(V, dtype=bool))


def fake_trained(run_dir: Path, with_weights: bool) -> None:
    fake_hidden_states(run_dir)  # stage 05 reads the sample layout stage 02 resolved
    fake_vocab(run_dir)  # and checks that the checkpoint was trained on stage 03's vocabulary (its fingerprint "f")
    folder = fake_stage(run_dir, "04_train", {"samples": 2, "best": None, "last_checkpoint": "checkpoints/0"},
                        inputs={"layer_ids": [2, 15, 27], "d2t": "f"})
    ckpt = folder / "checkpoints" / "0"
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3", "architectures": ["Eagle3DraftModel"]}))
    if with_weights:
        (ckpt / "model.safetensors").write_bytes(b"")


# Each case: (id, config overrides, setup(run_dir, tmp_path) -> extra args or None, script, args, expected text)
def _prompts(content: str):
    def setup(run_dir, tmp):
        path = tmp / "prompts.jsonl"
        path.write_text(content)
        return ["--set", f"data.prompts={path}"]
    return setup


def _prompt_bytes(content: bytes):
    def setup(run_dir, tmp):
        path = tmp / "prompts.jsonl"
        path.write_bytes(content)
        return ["--set", f"data.prompts={path}"]
    return setup


def _prompt_path(make):
    """data.prompts set to tmp/prompts.jsonl, made by `make(path)` (a pipe, a folder, a sparse file ...)."""
    def setup(run_dir, tmp):
        make(tmp / "prompts.jsonl")
        return ["--set", f"data.prompts={tmp / 'prompts.jsonl'}"]
    return setup


def _eval_path(make):
    def setup(run_dir, tmp):
        make(tmp / "eval.jsonl")
        return ["--set", f"data.eval_prompts={tmp / 'eval.jsonl'}"]
    return setup


def _sparse(size: int):
    def make(path: Path) -> None:
        with open(path, "wb") as f:
            f.truncate(size)  # no blocks written: the size check must refuse it without reading
    return make


def _train_with_an_eval_prompt(run_dir, tmp):
    lines = (REPO / "data" / "prompts_train.jsonl").read_text().splitlines()[:20]
    # An eval prompt ("Suggest five healthy snacks for work.") again, in other case, spacing and end punctuation.
    lines[11:11] = [json.dumps({"id": "copied", "prompt": "  suggest FIVE healthy   snacks for work!! "})]
    (tmp / "train.jsonl").write_text("\n".join(lines) + "\n")
    return ["--set", f"data.prompts={tmp / 'train.jsonl'}"]


def _drafter_folder(key: str, config_json: bool):
    def setup(run_dir, tmp):
        (tmp / "drafter").mkdir()
        if config_json:
            (tmp / "drafter" / "config.json").write_text("{}")
        return ["--set", f"{key}={tmp / 'drafter'}"]
    return setup


def _run_folder_holding(size: int):
    def setup(run_dir, tmp):
        (run_dir / "01_generate_data").mkdir(parents=True)
        (run_dir / "01_generate_data" / "leftover.bin").write_bytes(b"x" * size)
    return setup


def _finished_conversations(tokens: int):
    """A finished stage 01 whose token counts announce `tokens` tokens to capture."""
    def setup(run_dir, tmp):
        fake_stage(run_dir, "01_generate_data", {"samples": 1000, "prompt_tokens": tokens // 2,
                                                 "completion_tokens": tokens - tokens // 2})
    return setup


def _eval_is_train(run_dir, tmp):
    return ["--set", f"data.eval_prompts={REPO / 'data' / 'prompts_train.jsonl'}"]


def _eval_copy_of_train(run_dir, tmp):
    (tmp / "copy.jsonl").write_bytes((REPO / "data" / "prompts_train.jsonl").read_bytes())
    return ["--set", f"data.eval_prompts={tmp / 'copy.jsonl'}"]


def _config_file(text: bytes):
    """Replace the case's config with this content (the run config is rewritten after setup runs)."""
    def setup(run_dir, tmp):
        (tmp / "raw.yaml").write_bytes(text.replace(b"TINY", str(REPO / "configs" / "tiny.yaml").encode())
                                       .replace(b"ROOT", str(tmp / "data").encode()))
        return ["--config", str(tmp / "raw.yaml")]
    return setup


def _broken_manifest(kind: str):
    def setup(run_dir, tmp):
        folder = run_dir / "01_generate_data"
        folder.mkdir(parents=True)
        path = folder / "manifest.json"
        {"folder": lambda: path.mkdir(),
         "not-utf8": lambda: path.write_bytes(b'{"status": "compl\xe9te"}'),
         "not-json": lambda: path.write_text('{"status": "complete",'),
         "a-list": lambda: path.write_text("[1, 2]"),
         "no-status": lambda: path.write_text('{"inputs": {}, "counts": {}}'),
         "counts-a-list": lambda: path.write_text('{"status": "complete", "inputs": {}, "counts": []}'),
         }[kind]()
    return setup


def _set(*pairs):
    return lambda run_dir, tmp: [a for p in pairs for a in ("--set", p)]


def _not_a_model(run_dir, tmp):
    (tmp / "model").mkdir()
    return ["--set", f"verifier.path={tmp / 'model'}"]


SMOLLM2_SHAPE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": L, "hidden_size": H,
                 "vocab_size": V, "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536}

# SmolLM2's shape with DeepSeek-V3's MLA attention sizes (Kimi-K2's: a query latent, rope 64).
DEEPSEEK_SHAPE = {**SMOLLM2_SHAPE, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                  "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}


def _verifier_config(content: bytes | dict, key: str = "verifier.path"):
    """`key` set to a model folder whose config.json holds `content` (bytes as they are, a dict as JSON)."""
    def setup(run_dir, tmp):
        (tmp / "model").mkdir()
        (tmp / "model" / "config.json").write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
        return ["--set", f"{key}={tmp / 'model'}"]
    return setup


def test_possible_mla_sizes_are_read(tmp_path):
    from eagle_pipeline.verifier import Verifier

    for config in (DEEPSEEK_SHAPE, {**DEEPSEEK_SHAPE, "q_lora_rank": None}, {**SMOLLM2_SHAPE, "kv_lora_rank": None}):
        (tmp_path / "config.json").write_text(json.dumps(config))
        assert Verifier(tmp_path).raw_config == config


def _without(config: dict, key: str) -> dict:
    return {k: v for k, v in config.items() if k != key}


def _stage_02_counts_without(key: str):
    def setup(run_dir, tmp):
        fake_hidden_states(run_dir)
        path = run_dir / "02_extract_hidden" / "manifest.json"
        manifest = json.loads(path.read_text())
        del manifest["counts"][key]
        path.write_text(json.dumps(manifest))
    return setup


def _file_as_root(run_dir, tmp):
    (tmp / "afile").write_text("x")
    return ["--set", f"data_root={tmp / 'afile' / 'runs'}"]


def _busy_port(run_dir, tmp):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    _busy_port.sock = sock  # keep it bound while the stage runs
    return ["--set", f"serve.port={sock.getsockname()[1]}"]


CASES = [
    ("unknown-key", {"genration": {"max_tokens": 3}}, None, "01_generate_data.py", ["--dry-run"], "unknown key 'genration' in the top level"),
    ("misspelt-nested-key", {"train": {"learning_rate": 1}}, None, "04_train.py", [], "unknown key 'learning_rate' in section 'train'"),
    ("wrong-type", {"data": {"num_samples": "lots"}}, None, "01_generate_data.py", ["--dry-run"], "data.num_samples"),
    ("negative-count", {"train": {"epochs": 0}}, None, "04_train.py", [], "train.epochs"),
    ("bad-set-syntax", {}, _set("train.epochs"), "01_generate_data.py", ["--dry-run"], "expected dotted.key=value"),
    ("verifier-missing", {}, _set("verifier.path=/nonexistent/model"), "01_generate_data.py", ["--dry-run"], "verifier.path: /nonexistent/model is not a directory"),
    ("verifier-not-a-model", {}, _not_a_model, "01_generate_data.py", ["--dry-run"], "has no config.json"),
    ("unknown-embedded-model", {}, _set("verifier.path=embedded:gpt-5"), "01_generate_data.py", ["--dry-run"], "unknown embedded model 'gpt-5'"),
    ("prompts-missing", {}, _set("data.prompts=/nonexistent.jsonl"), "01_generate_data.py", ["--dry-run"], "data.prompts: /nonexistent.jsonl does not exist"),
    ("prompts-empty", {}, _prompts(""), "01_generate_data.py", ["--dry-run"], "holds no prompts"),
    ("prompts-malformed", {}, _prompts('{"prompt": "ok"}\n{not json\n'), "01_generate_data.py", ["--dry-run"], "prompts.jsonl:2: not valid JSON"),
    ("prompts-wrong-field", {}, _prompts('{"question": "hi"}\n'), "01_generate_data.py", ["--dry-run"], "set data.prompt_field"),
    # No budget: tiny.yaml's would refuse the disk that 5,000 samples plan first.
    ("too-many-samples", {"data": {"num_samples": 5000}, "disk_budget_gb": None}, None, "01_generate_data.py", ["--dry-run"], "data.num_samples: 5000 exceeds"),
    ("data-root-not-writable", {}, _file_as_root, "01_generate_data.py", [], "is a file; choose another data_root"),
    ("stage-before-its-input", {}, None, "04_train.py", [], "run 02_extract_hidden.py"),
    ("layer-id-out-of-range", {"hidden_states": {"layer_ids": [2, 15, 30]}}, lambda r, t: fake_conversations(r), "02_extract_hidden.py", ["--dry-run"], "hidden_states.layer_ids: 30 is out of range for a 30-layer verifier"),
    ("layer-id-duplicated", {"hidden_states": {"layer_ids": [2, 2, 27]}}, None, "02_extract_hidden.py", ["--dry-run"], "duplicates"),
    ("seq-len-beyond-model", {"hidden_states": {"max_seq_len": 4096}}, lambda r, t: fake_conversations(r), "02_extract_hidden.py", ["--dry-run"], "hidden_states.max_seq_len"),
    ("draft-vocab-too-large", {"vocab": {"draft_vocab_size": 60000}}, lambda r, t: fake_hidden_states(r), "03_build_vocab_map.py", ["--dry-run"], "vocab.draft_vocab_size: 60000 is larger than the target vocabulary (49152)"),
    ("hidden-state-nan", {}, lambda r, t: (fake_hidden_states(r, "nan"), fake_vocab(r)), "04_train.py", [], "hs_1.safetensors: hidden states contain NaN"),
    ("hidden-state-truncated", {}, lambda r, t: (fake_hidden_states(r, "truncated"), fake_vocab(r)), "04_train.py", [], "hs_1.safetensors: truncated"),
    ("hidden-state-missing", {}, lambda r, t: (fake_hidden_states(r, "missing"), fake_vocab(r)), "04_train.py", [], "1 hidden-state files for 2 dataset rows"),
    ("dataset-out-of-step", {}, lambda r, t: (fake_hidden_states(r, "out_of_step"), fake_vocab(r)), "04_train.py", [], "token ids differ from its dataset row"),
    ("init-from-not-a-drafter", {"train": {"init_from": "/nonexistent/drafter"}}, lambda r, t: (fake_hidden_states(r), fake_vocab(r)), "04_train.py", [], "train.init_from: /nonexistent/drafter does not exist"),
    ("checkpoint-without-weights", {}, lambda r, t: fake_trained(r, with_weights=False), "05_convert.py", [], "checkpoints/0"),
    ("reference-drafter-not-a-model", {"convert": {"reference_dir": "/nonexistent/ref"}}, lambda r, t: fake_trained(r, with_weights=True), "05_convert.py", [], "convert.reference_dir: /nonexistent/ref does not exist"),
    ("serve-port-in-use", {}, _busy_port, "06_serve_test.py", [], "serve.port"),
    ("dflash-mask-token-in-the-chat", {"train": {"family": "dflash", "dflash": {"mask_token_id": 2}}}, None,
     "04_train.py", ["--dry-run"], "train.dflash.mask_token_id: 2 (<|im_end|>) is written by the chat template"),
    # config files
    ("config-not-utf8", {}, _config_file(b"extends: TINY\nrun_name: caf\xe9\ndata_root: ROOT\n"),
     "01_generate_data.py", ["--dry-run"], "raw.yaml line 2: byte 0xe9 is not UTF-8"),
    ("config-duplicate-section", {}, _config_file(b"extends: TINY\ndata_root: ROOT\ntrain: {epochs: 2}\ntrain: {lr: 0.1}\n"),
     "01_generate_data.py", ["--dry-run"], "raw.yaml line 4: key 'train' appears again (first at line 3)"),
    ("config-extends-a-list", {}, _config_file(b"extends: [TINY]\ndata_root: ROOT\n"),
     "01_generate_data.py", ["--dry-run"], "extends: expected one base file name"),
    ("config-is-a-list", {}, _config_file(b"- TINY\n"), "01_generate_data.py", ["--dry-run"], "must be a YAML mapping"),
    ("config-is-a-folder", {}, lambda r, t: ["--config", str(t)], "01_generate_data.py", ["--dry-run"], "--config names a folder"),
    ("run-name-escapes", {}, _set("run_name=.."), "01_generate_data.py", [], "run_name: '..' must be a plain folder name"),
    ("data-root-empty", {}, _set("data_root=''"), "01_generate_data.py", [], "data_root: must not be empty"),
    ("engine-arg-misspelt", {"verifier": {"engine_args": {"enforce_eagr": True}}}, None, "02_extract_hidden.py", ["--dry-run"], "did you mean 'enforce_eager'"),
    # prompt files
    ("prompts-not-utf8", {}, _prompt_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n'),
     "01_generate_data.py", ["--dry-run"], "prompts.jsonl:2: byte 0xe9 is not UTF-8"),
    ("prompts-line-not-object", {}, _prompts('{"prompt": "ok"}\n["a list"]\n'),
     "01_generate_data.py", ["--dry-run"], "prompts.jsonl:2: expected a JSON object"),
    ("prompts-message-not-object", {}, _prompts('{"messages": ["hi"]}\n'),
     "01_generate_data.py", ["--dry-run"], "prompts.jsonl:1: messages[0] must be an object with 'role' and 'content'"),
    ("prompts-message-content-not-string", {}, _prompts('{"messages": [{"role": "user", "content": 3}]}\n'),
     "01_generate_data.py", ["--dry-run"], "prompts.jsonl:1: messages[0]: 'role' and 'content' must be strings"),
    ("prompts-blank-lines-only", {}, _prompts("\n\n"), "01_generate_data.py", ["--dry-run"], "holds no prompts"),
    ("prompts-duplicate-id", {}, _prompts('{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}\n'),
     "01_generate_data.py", ["--dry-run"], "prompts.jsonl:2: id 'a' was already used at"),
    ("eval-prompts-missing", {}, _set("data.eval_prompts=/nonexistent-eval.jsonl"),
     "01_generate_data.py", ["--dry-run"], "data.eval_prompts: /nonexistent-eval.jsonl does not exist"),
    ("eval-prompts-are-the-training-file", {}, _eval_is_train, "01_generate_data.py", ["--dry-run"], "is the same file as data.prompts"),
    ("eval-prompts-copy-the-training-file", {}, _eval_copy_of_train, "01_generate_data.py", ["--dry-run"], "holds the same prompts as data.prompts"),
    # prompt files: what they are, how large, what their lines hold
    ("prompts-a-named-pipe", {}, _prompt_path(os.mkfifo), "01_generate_data.py", ["--dry-run"],
     "prompts.jsonl is a named pipe, not a regular file"),
    ("eval-prompts-a-named-pipe", {}, _eval_path(os.mkfifo), "01_generate_data.py", ["--dry-run"],
     ("data.eval_prompts: ", "eval.jsonl is a named pipe, not a regular file")),
    ("prompts-a-device", {}, _set("data.prompts=/dev/zero"), "01_generate_data.py", ["--dry-run"],
     "data.prompts: /dev/zero is a character device, not a regular file"),
    ("prompts-a-folder-named-like-a-file", {}, _prompt_path(Path.mkdir), "01_generate_data.py", ["--dry-run"],
     "prompts.jsonl is a folder, not a JSONL file"),
    ("prompts-file-too-large", {}, _prompt_path(_sparse((8 << 30) + 1)), "01_generate_data.py", ["--dry-run"],
     "prompts.jsonl is 8.0 GiB, above the 8.0 GiB a prompt file may hold"),
    ("prompts-line-too-long", {}, _prompts('{"prompt": "ok"}\n{"prompt": "' + "x" * (1 << 20) + '"}\n'),
     "01_generate_data.py", ["--dry-run"], "prompts.jsonl:2: line longer than 1.0 MiB"),
    ("prompts-nested-too-deeply", {}, _prompts('{"prompt": "ok"}\n' + "[" * 200_000 + "]" * 200_000 + "\n"),
     "01_generate_data.py", ["--dry-run"], "prompts.jsonl:2: JSON nested too deeply to read"),
    ("prompts-lone-surrogate", {}, _prompts('{"prompt": "ok"}\n{"prompt": "half a pair \\ud800 here"}\n'),
     "01_generate_data.py", ["--dry-run"], "prompts.jsonl:2: holds a lone surrogate (U+D800"),
    ("prompts-torn-utf8-sequence", {}, _prompt_bytes(b'{"prompt": "ok"}\n\n{"prompt": "caf\xc3("}\n'),
     "01_generate_data.py", ["--dry-run"], "prompts.jsonl:3: byte 0xc3 is not UTF-8"),
    ("prompts-ask-an-eval-prompt", {}, _train_with_an_eval_prompt, "01_generate_data.py", ["--dry-run"],
     "data.prompts: 1 training prompt(s) ask what a held-out prompt of data.eval_prompts asks"),
    ("prompts-too-long-for-the-model", {"verifier": {"max_model_len": 64}, "generation": {"max_tokens": 32},
                                        "hidden_states": {"max_seq_len": 48}, "serve": {"max_tokens": 32},
                                        "data": {"num_samples": 2}},
     _prompts('{"id": "a", "prompt": "Name a colour."}\n{"id": "b", "prompt": "' + "many words " * 200 + '"}\n'),
     "01_generate_data.py", [], "data.num_samples: 2 conversations wanted but only 1 of the 2 prompts"),
    # folders the config names, the target's heads, the disk budget (eagle_pipeline/plan/preconditions.py)
    *[(f"{key}-missing", {}, _set(f"{key}=/nonexistent/folder"), "01_generate_data.py", ["--dry-run"],
       f"{key}: /nonexistent/folder does not exist")
      for key in ("vocab.from_drafter", "train.init_from", "convert.reference_dir", "serve.drafter", "serve.baseline")],
    *[(f"{key}-without-config", {}, _drafter_folder(key, config_json=False), script, ["--dry-run"],
       (f"{key}: ", "drafter has no config.json, so it is not a drafter folder")) for key, script in (("vocab.from_drafter", "01_generate_data.py"), ("train.init_from", "02_extract_hidden.py"),
                                       ("convert.reference_dir", "03_build_vocab_map.py"), ("serve.drafter", "06_serve_test.py"))],
    ("tensor-parallel-splits-no-heads", {}, _set("verifier.tensor_parallel_size=2"), "01_generate_data.py", ["--dry-run"],
     "verifier.tensor_parallel_size: 2 does not divide the 9 attention heads of the target"),
    # 9 ranks split SmolLM2's 9 heads (and its 3 key/value heads) evenly, on more GPUs than a test host has.
    ("tensor-parallel-beyond-the-host", {"device": "cuda"}, _set("verifier.tensor_parallel_size=9"), "04_train.py", ["--dry-run"],
     "this host has"),
    ("train-gpus-beyond-the-host", {"train": {"num_gpus": 64}}, None, "02_extract_hidden.py", ["--dry-run"],
     "train.num_gpus: 64, but this host has"),
    ("run-folder-above-the-budget", {"disk_budget_gb": 1e-5}, _run_folder_holding(20_000), "05_convert.py", ["--dry-run"],
     "disk_budget_gb: the run folder"),
    ("hidden-states-above-the-budget", {"disk_budget_gb": 0.5}, _finished_conversations(200_000), "02_extract_hidden.py",
     ["--dry-run"], "disk_budget_gb: stage 02's hidden states (~0.92 GB for 200000 tokens)"),
    # the target's config.json and a drafter's, damaged or foreign (read before anything else of the folder)
    ("verifier-config-of-a-drafter", {}, _verifier_config({"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"]}),
     "01_generate_data.py", ["--dry-run"], "config.json is an EAGLE-3 drafter's config, not a target model's"),
    ("verifier-config-of-a-flat-drafter", {}, _verifier_config({**SMOLLM2_SHAPE, "architectures": ["LlamaForCausalLMEagle3"]}),
     "02_extract_hidden.py", ["--dry-run"], "config.json is an EAGLE-3 drafter's config, not a target model's"),
    ("verifier-config-a-list", {}, _verifier_config(b"[1, 2]"), "01_generate_data.py", ["--dry-run"],
     ("verifier.path: ", "config.json: model config is a JSON list, not an object")),
    ("verifier-config-not-utf8", {}, _verifier_config(b'{"model_type": "caf\xe9"}'), "01_generate_data.py", ["--dry-run"],
     ("verifier.path: ", "config.json: model config is not UTF-8 text; restore the target model's own config.json")),
    ("verifier-config-without-intermediate-size", {}, _verifier_config(_without(SMOLLM2_SHAPE, "intermediate_size")),
     "04_train.py", ["--dry-run"], "config.json: intermediate_size is missing"),
    ("verifier-text-config-a-string", {}, _verifier_config({"architectures": ["X"], "text_config": "llama"}),
     "02_extract_hidden.py", ["--dry-run"], "config.json: text_config is a JSON str, not an object"),
    ("verifier-config-layers-a-string", {}, _verifier_config({**SMOLLM2_SHAPE, "num_hidden_layers": "30"}),
     "02_extract_hidden.py", ["--dry-run"], "config.json: num_hidden_layers is '30', not a positive integer"),
    # impossible MLA attention sizes: every tensor shape of the target (and an MLA drafter) is computed from them
    *[(f"verifier-config-mla-{key}-{value}", {}, _verifier_config({**DEEPSEEK_SHAPE, key: value}), "02_extract_hidden.py",
       ["--dry-run"], f"config.json: {key} is {value!r}, not a positive {'even ' * (key == 'qk_rope_head_dim')}integer")
      for key, value in (("kv_lora_rank", 0), ("kv_lora_rank", -512), ("kv_lora_rank", "512"), ("q_lora_rank", -1),
                         ("q_lora_rank", 0), ("qk_rope_head_dim", 63), ("qk_rope_head_dim", 0), ("qk_nope_head_dim", -128),
                         ("v_head_dim", 0), ("v_head_dim", 1.5))],
    ("verifier-config-mla-without-v-head-dim", {}, _verifier_config(_without(DEEPSEEK_SHAPE, "v_head_dim")), "02_extract_hidden.py",
     ["--dry-run"], "config.json: v_head_dim is missing"),
    ("verifier-text-config-mla-kv-lora-rank-0", {}, _verifier_config({"architectures": ["KimiK25ForConditionalGeneration"],
                                                                        "text_config": {**DEEPSEEK_SHAPE, "kv_lora_rank": 0}}),
     "02_extract_hidden.py", ["--dry-run"], "config.json: text_config.kv_lora_rank is 0, not a positive integer"),
    *[(f"init-from-config-{kind}", {}, lambda r, t, c=content: (fake_hidden_states(r), fake_vocab(r),
                                                                 _verifier_config(c, "train.init_from")(r, t))[-1],
       "04_train.py", ["--dry-run"], ("train.init_from: ", f"config.json: drafter config {text}"))
      for kind, content, text in (("not-utf8", b'{"architectures": ["caf\xe9"]}', "is not UTF-8 text"),
                                  ("a-list", b'["LlamaForCausalLMEagle3"]', "is a JSON list, not an object"))],
    ("stage-02-counts-without-target-vocab-size", {}, _stage_02_counts_without("target_vocab_size"), "03_build_vocab_map.py",
     ["--dry-run"], "02_extract_hidden/manifest.json: its counts lack 'target_vocab_size'"),
    ("stage-02-counts-without-samples", {}, lambda r, t: (_stage_02_counts_without("samples")(r, t), fake_vocab(r))[-1],
     "04_train.py", [], "02_extract_hidden/manifest.json: its counts lack 'samples'"),
    # manifests
    *[(f"manifest-{kind}", {}, _broken_manifest(kind), "02_extract_hidden.py", ["--dry-run"], "rerun that stage (01_generate_data.py) with --force")
      for kind in ("folder", "not-utf8", "not-json", "a-list", "no-status", "counts-a-list")],
    ("own-manifest-damaged", {}, _broken_manifest("not-json"),
     "01_generate_data.py", ["--dry-run"], "01_generate_data/manifest.json: manifest is not valid JSON"),
]


# A folder the config names is refused when missing by every stage's dry run, not only by the stage that reads it
# (eagle_pipeline/plan/preconditions.py): stage 01 is tried with each above; here each other stage with one of them.
REFERENCED_FOLDERS = ("vocab.from_drafter", "train.init_from", "convert.reference_dir", "serve.drafter", "serve.baseline")
LATER_STAGES = ("02_extract_hidden.py", "03_build_vocab_map.py", "04_train.py", "05_convert.py", "06_serve_test.py")
CASES += [(f"{key}-missing-for-{script[:2]}", {}, _set(f"{key}=/nonexistent/{key}"), script, ["--dry-run"],
           f"{key}: /nonexistent/{key} does not exist")
          for key, script in zip(REFERENCED_FOLDERS, LATER_STAGES)]

# train.draft_layer mla on the Llama target: every stage names it before its disk plan reads MLA dimensions, and
# stage 04 before --force deletes its finished output.
CASES += [(f"draft-layer-mla-on-a-llama-target-{script[:2]}{'-force' if setup else ''}", {"train": {"draft_layer": "mla"}},
           setup, script, ["--force"] if setup else ["--dry-run"], "train.draft_layer: mla needs a verifier with MLA attention")
          for script, setup in [(s, None) for s in ("01_generate_data.py", *LATER_STAGES)]
          + [("04_train.py", lambda r, t: fake_trained(r, with_weights=True))]]

# A released MLA drafter built for another target than the MLA one the run names: what vLLM's MLA drafter shares with
# the target (latent and head sizes, YaRN rope) is compared from the two config.json files at every stage's start.
MLA_TARGET = {**DEEPSEEK_SHAPE, "rope_theta": 50000.0, "rope_scaling": dict(KIMI_YARN)}
MLA_RELEASE = mla_standin_config(KIMI_MLA_STANDIN.but(hidden_size=H, vocab_size=V, q_lora_rank=1536,
                                                      qk_nope_head_dim=128, v_head_dim=128, hf_layer_ids=(2, 15, 27)))
RELEASE_DIFFERENCES = {  # name: (what the release has instead, what the error line says)
    **{f"{key}-{value}": ({key: value}, f"{key} {value} differs from the target's {key} {MLA_TARGET[key]}")
       for key, value in (("q_lora_rank", 768), ("kv_lora_rank", 256), ("qk_nope_head_dim", 64), ("qk_rope_head_dim", 32),
                          ("v_head_dim", 64))},
    **{f"yarn-{key}": ({"rope_scaling": {**KIMI_YARN, key: value}},
                       f"rope_scaling.{key} {value} differs from the target's rope_scaling.{key} {KIMI_YARN[key]}")
       for key, value in (("factor", 32.0), ("mscale_all_dim", 0.707), ("original_max_position_embeddings", 8192))},
    "no-yarn": ({"rope_scaling": None}, "rope_scaling.rope_type default differs from the target's rope_scaling.rope_type yarn"),
}


def _mla_release(key: str, changes: dict, setup=None):
    """verifier.path: an MLA target; `key`: a released MLA drafter's folder (its config.json only) with `changes`."""
    def make(run_dir, tmp):
        for folder, config in (("model", MLA_TARGET), ("release", {**MLA_RELEASE, **changes})):
            (tmp / folder).mkdir()
            (tmp / folder / "config.json").write_text(json.dumps(config))
        if setup:
            setup(run_dir, tmp)
        return ["--set", f"verifier.path={tmp / 'model'}", "--set", f"{key}={tmp / 'release'}"]
    return make


CASES += [(f"{key}-mla-{name}", {}, _mla_release(key, changes), "01_generate_data.py",
           ["--dry-run"], (f"{key}: ", f"release/config.json: {expected}; the drafter was built for another target model"))
          for key in ("train.init_from", "vocab.from_drafter") for name, (changes, expected) in RELEASE_DIFFERENCES.items()]
# Before stage 01 starts an engine, and before stage 04's --force deletes its finished output.
CASES += [("train.init_from-mla-yarn-factor-01", {}, _mla_release("train.init_from", RELEASE_DIFFERENCES["yarn-factor"][0]),
           "01_generate_data.py", [], "rope_scaling.factor 32.0 differs"),
          ("train.init_from-mla-q_lora_rank-04-force", {}, _mla_release("train.init_from", {"q_lora_rank": 768},
                                                                        lambda r, t: fake_trained(r, with_weights=True)),
           "04_train.py", ["--force"], "q_lora_rank 768 differs from the target's q_lora_rank 1536")]


@pytest.mark.parametrize("spelling", ["rope_scaling", "rope_parameters"])
def test_a_released_mla_drafters_rope_is_compared_in_either_spelling(tmp_path, spelling):
    from eagle_pipeline.config import load_config
    from eagle_pipeline.errors import BadInput
    from eagle_pipeline.plan.preconditions import check_drafters_against_target

    def release(factor: float) -> dict:  # transformers 4 spelling (the release's) or 5's
        yarn = {**KIMI_YARN, "factor": factor}
        return {"rope_scaling": yarn} if spelling == "rope_scaling" else {"rope_scaling": None, "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 50000.0, **{k: v for k, v in yarn.items() if k != "type"}}}

    for factor, refused in ((64.0, False), (32.0, True)):
        folder = tmp_path / str(factor)
        folder.mkdir()
        overrides = _mla_release("train.init_from", release(factor))(None, folder)[1::2]
        cfg = load_config(write_config(folder / "c.yaml"), [*overrides, f"vocab.from_drafter={folder / 'release'}"])
        if refused:
            with pytest.raises(BadInput, match=r"^vocab.from_drafter: \S+: rope_scaling.factor 32.0 differs"):
                check_drafters_against_target(cfg)
        else:
            check_drafters_against_target(cfg)

def _symlink_loop(run_dir, tmp):
    (tmp / "a.jsonl").symlink_to(tmp / "b.jsonl")
    (tmp / "b.jsonl").symlink_to(tmp / "a.jsonl")
    return ["--set", f"data.prompts={tmp / 'a.jsonl'}"]


def _closed_port_endpoint(run_dir, tmp):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there: the dry run must ask, and be refused
    return ["--set", "hidden_states.mode=online", "--set", f"hidden_states.capture_endpoints=[http://127.0.0.1:{port}/v1]"]


def _kept_answers(folder: Path, answers: dict | None = None, raw: bytes | None = None) -> None:
    (folder / "answers.json").write_bytes(raw if raw is not None else json.dumps(answers).encode())


def _torn(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-40])


# Every file of a kept baseline (06_serve_test/baseline/) that stage 06 reads, damaged: name -> (damage(folder,
# answers), what the error line says). The answers are whole unless the damage rewrites them.
BASELINE_DEFECTS = {
    "answers-torn": (lambda f, a: _kept_answers(f, raw=json.dumps(a).encode()[:-30]), "answers.json: is not valid JSON"),
    "answers-not-utf8": (lambda f, a: _kept_answers(f, raw=b'{"texts": "\xff"}'), "answers.json: is not UTF-8 text"),
    "answers-a-list": (lambda f, a: _kept_answers(f, raw=b"[]"), "answers.json: is a JSON list, not an object"),
    "answers-missing": (lambda f, a: None, "answers.json: is missing"),
    "answers-without-summary": (lambda f, a: _kept_answers(f, {k: v for k, v in a.items() if k != "summary"}),
                                "answers.json: does not hold what stage 06 keeps"),
    "answers-fewer-ids-than-texts": (lambda f, a: _kept_answers(f, {**a, "token_ids": a["token_ids"][:1]}),
                                     "answers.json: does not hold what stage 06 keeps"),
    "states-torn": (lambda f, a: (_kept_answers(f, a), _torn(f / "hs_1.safetensors")),
                    "hs_1.safetensors: cannot be read (SafetensorError"),
    "states-missing": (lambda f, a: (_kept_answers(f, a), (f / "hs_1.safetensors").unlink()),
                       "hs_1.safetensors: cannot be read (FileNotFoundError"),
    "states-without-hidden-states": (lambda f, a: (_kept_answers(f, a), __import__("safetensors.torch").torch.save_file(
        {"x": torch.zeros(1)}, str(f / "hs_1.safetensors"))), "hs_1.safetensors: cannot be read"),
}


def make_kept_baseline(folder: Path, damage: str | None) -> None:
    """A kept baseline of two answers and their captured states in folder/baseline, with BASELINE_DEFECTS[damage]."""
    from safetensors.torch import save_file

    (folder / "baseline").mkdir(parents=True)
    answers = {"shaped_by": {}, "texts": ["a", "b"], "token_ids": [[[1], [2]], [[1], [3]]],
               "summary": {"tokens_per_s": 9.0}, "captured_layer_ids": [2, 15, 27]}
    for i in range(2):
        save_file({"hidden_states": torch.zeros(3, 4, 8)}, str(folder / "baseline" / f"hs_{i}.safetensors"))
    (BASELINE_DEFECTS[damage][0] if damage else _kept_answers)(folder / "baseline", answers)


def _damaged_baseline(damage: str, own: bool = False):
    """Stages 01-05 done and serve.baseline set to a 06_serve_test folder (this run's own when `own`) whose
    kept baseline has `damage`."""
    def setup(run_dir, tmp):
        fake_trained(run_dir, with_weights=True)
        fake_stage(run_dir, "05_convert", {"samples": 2})
        folder = fake_stage(run_dir, "06_serve_test", {"samples": 2}) if own else tmp / "kept"
        make_kept_baseline(folder, damage)
        return ["--set", f"serve.baseline={folder}"]
    return setup


CASES += [(f"serve-baseline-{damage}{'-dry-run' if dry else ''}", {}, _damaged_baseline(damage), "06_serve_test.py",
           ["--dry-run"] if dry else [], (expected, "; point serve.baseline at a finished 06_serve_test folder"))
          for damage, (_, expected) in BASELINE_DEFECTS.items() for dry in (False, True)]
# README's cheap rerun points serve.baseline at this run's own stage 06 and passes --force: nothing is deleted.
CASES += [("serve-baseline-own-answers-torn", {}, _damaged_baseline("answers-torn", own=True), "06_serve_test.py",
           ["--force"], "06_serve_test/baseline/answers.json: is not valid JSON")]


@pytest.mark.parametrize("damage", [None, *BASELINE_DEFECTS])
def test_a_damaged_baseline_of_this_stage_is_served_again_not_read(tmp_path, damage):
    # Stage 06's own folder, kept by an earlier run of the same settings: a damaged file is made again, not read.
    from eagle_pipeline.serve.baseline import kept_baseline

    make_kept_baseline(tmp_path, damage)
    kept = kept_baseline(tmp_path, {})
    assert (kept is None) == (damage is not None) and (kept is None or kept["texts"] == ["a", "b"])


# Wording: what YAML typed, what an override broke, a link loop, an endpoint's port, a repeated engine variant,
# an unknown flag; and what a dry run now asks as the run does (a capture endpoint).
CASES += [
    ("run-name-a-date", {}, _config_file(b"extends: TINY\ndata_root: ROOT\nrun_name: 2024-06-01\n"), "01_generate_data.py",
     ["--dry-run"], 'run_name: YAML read the unquoted value as a date (2024-06-01), not text; quote it, e.g. run_name: "2024-06-01"'),
    ("run-name-off", {}, _config_file(b"extends: TINY\ndata_root: ROOT\nrun_name: off\n"), "01_generate_data.py",
     ["--dry-run"], "run_name: YAML read the unquoted value as the boolean false"),
    ("env-a-number", {}, _config_file(b"extends: TINY\ndata_root: ROOT\nenv: {OMP_NUM_THREADS: 4}\n"), "01_generate_data.py",
     ["--dry-run"], 'env.OMP_NUM_THREADS: YAML read the unquoted value as the number 4, not text; quote it, e.g. OMP_NUM_THREADS: "4"'),
    ("cross-field-blames-the-set", {}, _set("verifier.max_model_len=200"), "01_generate_data.py", ["--dry-run"],
     "error: --set verifier.max_model_len=200: generation.max_tokens: 256 must be below verifier.max_model_len (200)"),
    ("prompts-a-symlink-loop", {}, _symlink_loop, "01_generate_data.py", ["--dry-run"],
     ("data.prompts: ", "a.jsonl is a symbolic link loop")),
    ("capture-endpoint-port-out-of-range", {"hidden_states": {"mode": "online", "capture_endpoints": ["http://me:pw@10.0.0.5:99999/v1"]}},
     None, "04_train.py", ["--dry-run"], "hidden_states.capture_endpoints: 'http://me:***@10.0.0.5:99999/v1': its port is not a number"),
    ("engine-variant-twice", {"serve": {"engine_variants": [{"verifier.model_runner": "v1"}, {"verifier.model_runner": "v1"}]}},
     None, "06_serve_test.py", ["--dry-run"], "serve.engine_variants: entry 1 repeats entry 0"),
    ("unknown-flag", {}, None, "01_generate_data.py", ["--dry-run", "--froce"],
     "error: unrecognized arguments: --froce; 01_generate_data.py --help lists the options"),
    ("set-an-integer-too-long", {}, _set("data.num_samples=" + "9" * 5000), "01_generate_data.py", ["--dry-run"],
     "error: --set data.num_samples: an integer of 5000 characters, longer than any setting needs"),
    ("capture-endpoint-not-answering", {}, _closed_port_endpoint, "04_train.py", ["--dry-run"],
     ("hidden_states.capture_endpoints: http://127.0.0.1:", "does not answer as a vLLM server")),
]
# Engine arguments that would make the engine compute another target than the folder every manifest fingerprints.
CASES += [(f"engine-arg-{key}", {"verifier": {"engine_args": {key: "x"}}}, None, "02_extract_hidden.py", ["--dry-run"],
           (f"verifier.engine_args.{key}: ", "remove it"))
          for key in sorted(__import__("eagle_pipeline.config.verifier", fromlist=["x"]).ENGINE_ARGS_REFUSED)]


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in root.rglob("*") if p.is_file() and "logs" not in p.parts and p.name != "config.yaml"}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_one_clear_line_and_loses_nothing(tmp_path, capsys, case):
    # The stage's command line in this process (stage.main, as `python 0N_stage.py` runs it): every case is
    # refused before a model loads, so a fresh interpreter per case would only add seconds.
    name, overrides, setup, script, args, expected = case
    root = tmp_path / "data"
    run_dir = root / "r"
    config = write_config(tmp_path / "run.yaml", data_root=str(root), run_name="r", **overrides)
    extra = (setup(run_dir, tmp_path) if setup else None) or []
    extra = extra if isinstance(extra, list) else []
    before = snapshot(root)
    code, _, stderr = run_stage_in_process(script, config, capsys, *args, *extra)
    lines = without_log_records(stderr)
    errors = [line for line in lines if line.startswith("error")]
    assert code == 2, f"{name}: exit {code}\n{stderr[-2000:]}"
    # Progress bars may precede it on stderr; the error itself is one line, the last one.
    assert len(errors) == 1 and lines[-1] == errors[0] and errors[0].startswith("error: "), f"{name}:\n{stderr[-2000:]}"
    for text in (expected,) if isinstance(expected, str) else expected:
        assert text in errors[0], f"{name}: {errors[0]!r} lacks {text!r}"
    assert snapshot(root) == before, f"{name}: files under the data root changed"


def test_missing_required_value_from_a_full_config(tmp_path):
    data = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    del data["data"]["num_samples"]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    result = run_stage("01_generate_data.py", path, "--dry-run")
    assert result.returncode == 2 and "data.num_samples is required" in result.stderr


def test_config_that_extends_a_missing_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("extends: base-missing.yaml\nrun_name: x\n")
    result = run_stage("01_generate_data.py", path, "--dry-run")
    assert result.returncode == 2 and "base-missing.yaml: config file not found" in result.stderr


# -- config files built to exhaust the loader: each refused at once, in one line (generated) ------------------

def _alias_bomb(levels: int = 8, width: int = 9) -> str:
    """A few hundred bytes of YAML that expand to width**levels values: each anchor repeats the one before."""
    return "{" + ", ".join([f"l0: &l0 [{', '.join(['x'] * width)}]"] + [
        f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels)]) + "}"


EXHAUSTING_CONFIGS = {
    # name: (the lines after `extends: tiny.yaml` and `data_root`, or what makes the base; what the error line says)
    **{f"alias-bomb-{where}": (text.replace("BOMB", _alias_bomb()), "aliases expand to more than 100000 values here")
       for where, text in {"unknown-key": "junk: BOMB", "unknown-key-in-a-section": "train: {junk: BOMB}",
                           "engine-args": "verifier: {engine_args: {compilation_config: BOMB}}",
                           "chat-template-kwargs": "generation: {chat_template_kwargs: BOMB}"}.items()},
    "anchor-inside-itself": ("verifier: {engine_args: {compilation_config: &a [1, *a]}}",
                             "line 3: aliases expand to more than 100000 values here"),
    # int() refuses more than 4,300 digits; a hex number's digits are not limited, but a long one prints as no number.
    "integer-too-long": ("data: {num_samples: " + "9" * 5000 + "}", "line 3: an integer of 5000 characters"),
    "hex-integer-too-long": ("junk: 0x" + "f" * 4000, "line 3: an integer of 4002 characters"),
    **{f"nested-{depth}-deep": ("verifier: {engine_args: {compilation_config: " + "[" * depth + "]" * depth + "}}",
                                "values nested deeper than the YAML reader's stack allows") for depth in (490, 5000)},
    "nested-mappings": ("junk: " + "{a: " * 1000 + "1" + "}" * 1000, "values nested deeper than the YAML reader's stack"),
    # a callable makes the base the config extends
    "extends-chain-of-150": (lambda tmp: _extends_chain(tmp, 150), "its 'extends' chain is more than 100 files long"),
}


def _extends_chain(tmp: Path, length: int) -> Path:
    for i in range(1, length):
        (tmp / f"c{i}.yaml").write_text(f"extends: c{i + 1}.yaml\n")
    (tmp / f"c{length}.yaml").write_text(f"extends: {REPO / 'configs' / 'tiny.yaml'}\n")
    return tmp / "c1.yaml"


@pytest.mark.parametrize("name", EXHAUSTING_CONFIGS)
def test_a_config_built_to_exhaust_the_loader_is_refused_at_once(tmp_path, capsys, name):
    import time

    text, expected = EXHAUSTING_CONFIGS[name]
    base, text = (text(tmp_path), "") if callable(text) else (REPO / "configs" / "tiny.yaml", text)
    config = tmp_path / "raw.yaml"
    config.write_text(f"extends: {base}\ndata_root: {tmp_path / 'data'}\n{text}\n")
    started = time.monotonic()
    code, _, stderr = run_stage_in_process("01_generate_data.py", config, capsys, "--dry-run")
    elapsed = time.monotonic() - started
    lines = without_log_records(stderr)
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"error: {config}") and expected in lines[0], stderr[-2000:]
    assert elapsed < 5, f"{name}: refused after {elapsed:.1f} s"  # unchecked, the expansion took minutes


def test_ordinary_anchors_and_aliases_still_load(tmp_path):
    from eagle_pipeline.config import load_config

    config = tmp_path / "anchors.yaml"
    config.write_text(f"extends: {REPO / 'configs' / 'tiny.yaml'}\ndata_root: {tmp_path / 'data'}\n"
                      "generation: {max_tokens: &n 96, chat_template_kwargs: {enable_thinking: false}}\n"
                      "serve: {max_tokens: *n}\n"
                      "verifier: {engine_args: {compilation_config: {sizes: &s [1, 2, 4], again: [*s, *s, *s]}}}\n"
                      "train: {<<: {epochs: 2, lr: 0.002}, lr: 0.001}\n")
    cfg = load_config(config, ["generation.chat_template_kwargs={a: &x [1, 2], b: *x}"])
    assert cfg.generation.max_tokens == cfg.serve.max_tokens == 96 and (cfg.train.epochs, cfg.train.lr) == (2, 0.001)
    assert cfg.verifier.engine_args["compilation_config"]["again"] == [[1, 2, 4]] * 3
    assert cfg.generation.chat_template_kwargs == {"a": [1, 2], "b": [1, 2]}


def _interrupted_training(config: Path) -> int:
    """Stage 04 run in this process with its input checks passed and training stopped by Ctrl-C; its exit code."""
    from unittest import mock

    from eagle_pipeline.stage import main

    module = stage_module("04_train.py")
    with mock.patch.object(module, "check_inputs"), mock.patch("eagle_pipeline.train.runner.train_drafter", side_effect=KeyboardInterrupt):
        try:
            main(4, module.__doc__, module.run, ["--config", str(config)])
        except SystemExit as e:
            return e.code
    return 0


def test_changed_train_setting_is_refused_naming_it(tmp_path):
    root = tmp_path / "data"
    run_dir = root / "r"
    config = write_config(tmp_path / "run.yaml", data_root=str(root), run_name="r")
    fake_hidden_states(run_dir)
    fake_vocab(run_dir)
    # Every input is checked before the stage writes anything: the fake vocab map is refused, no manifest left.
    first = run_stage("04_train.py", config)
    assert first.returncode == 2 and "marks 0 tokens" in first.stderr, first.stderr[-2000:]
    assert not (run_dir / "04_train" / "manifest.json").exists()
    # A run interrupted once training started (input checks passed) has recorded its inputs.
    interrupted = _interrupted_training(config)
    assert interrupted == 130 and json.loads((run_dir / "04_train" / "manifest.json").read_text())["status"] == "running"
    before = snapshot(root)

    result = run_stage("04_train.py", config, "--set", "train.lr=0.002")
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2, result.stderr[-2000:]
    assert last.startswith("error: ") and "input 'train.lr' changed" in last and "--force" in last, last
    assert snapshot(root) == before

    # A resumable setting is not an input: the rerun gets past the manifest to the same vocab map check.
    resumed = run_stage("04_train.py", config, "--set", "train.epochs=9")
    assert resumed.returncode == 2 and "marks 0 tokens" in resumed.stderr.strip().splitlines()[-1], resumed.stderr[-2000:]


def test_force_replaces_a_damaged_manifest_that_a_plain_rerun_refuses(tmp_path):
    from eagle_pipeline.config import load_config
    from eagle_pipeline.errors import BadInput
    from eagle_pipeline.stage import Stage, Start

    cfg = load_config(write_config(tmp_path / "run.yaml", data_root=str(tmp_path / "data"), run_name="r"))
    folder = cfg.stage_dir("03_build_vocab_map")
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text("not json")
    (folder / "d2t.npy").write_bytes(b"old")
    with pytest.raises(BadInput, match=r"manifest\.json: manifest is not valid JSON .*rerun that stage \(03_build_vocab_map\.py\) with --force"):
        Stage(3, cfg, force=False).start({"x": "1"})
    assert (folder / "d2t.npy").exists()
    assert not Stage(3, cfg, force=True).already_complete({"x": "1"})
    assert Stage(3, cfg, force=True).start({"x": "1"}) is Start.STARTED
    assert not (folder / "d2t.npy").exists() and json.loads((folder / "manifest.json").read_text())["status"] == "running"


# -- every prompt-file defect, for the training and the held-out file alike (generated) ---------------------

def _fifo(path: Path) -> None:
    os.mkfifo(path)


PROMPT_FILE_DEFECTS = {
    # name: (make the file at path, what the error line says)
    "named-pipe": (_fifo, "is a named pipe, not a regular file"),
    "folder-named-jsonl": (Path.mkdir, "is a folder, not a JSONL file"),
    "too-large": (_sparse((8 << 30) + 1), "above the 8.0 GiB a prompt file may hold"),
    "line-too-long": (lambda p: p.write_text('{"prompt": "' + "x" * (1 << 20) + '"}\n'), ":1: line longer than 1.0 MiB"),
    "nested-too-deeply": (lambda p: p.write_text("[" * 200_000 + "]" * 200_000 + "\n"), ":1: JSON nested too deeply"),
    "lone-surrogate": (lambda p: p.write_text('{"prompt": "a"}\n{"prompt": "\\udfff"}\n'), ":2: holds a lone surrogate (U+DFFF"),
    "not-utf8": (lambda p: p.write_bytes(b'{"prompt": "\xff"}\n'), ":1: byte 0xff is not UTF-8"),
    "not-json": (lambda p: p.write_text('{"prompt": "a"}\n{"prompt": \n'), ":2: not valid JSON"),
    "not-an-object": (lambda p: p.write_text('"a string"\n'), ":1: expected a JSON object"),
    "no-prompts": (lambda p: p.write_text("\n \n"), "holds no prompts"),
}
PROMPT_FILE_CASES = [(key, defect) for key in ("data.prompts", "data.eval_prompts") for defect in PROMPT_FILE_DEFECTS]


@pytest.mark.parametrize("key,defect", PROMPT_FILE_CASES, ids=[f"{k}-{d}" for k, d in PROMPT_FILE_CASES])
def test_every_prompt_file_defect_is_refused_naming_the_file(tmp_path, key, defect):
    import threading

    from eagle_pipeline.errors import BadInput
    from eagle_pipeline.prompts import load_training_and_eval_prompts

    make, expected = PROMPT_FILE_DEFECTS[defect]
    paths = {"data.prompts": REPO / "data" / "prompts_train.jsonl", "data.eval_prompts": REPO / "data" / "prompts_eval.jsonl"}
    paths[key] = tmp_path / "bad.jsonl"
    make(paths[key])
    outcome: list[BaseException | None] = []

    def load() -> None:
        try:
            load_training_and_eval_prompts(paths["data.prompts"], paths["data.eval_prompts"], "prompt")
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - recorded for the assertions below
            outcome.append(e)

    # A named pipe that were opened would block the reader for good: it must answer without reading.
    reader = threading.Thread(target=load, daemon=True)
    reader.start()
    reader.join(60)
    assert outcome, f"{key} {defect}: the loader did not return (it opened what it must only stat)"
    error = outcome[0]
    assert isinstance(error, BadInput), f"{key} {defect}: {error!r}"
    message = str(error)
    assert "\n" not in message and expected in message and str(paths[key]) in message, message


# -- every value the OS cannot carry, for every key that reaches a process (generated) --------------------------
# Config values reach processes as command-line arguments (`--set key=value`, the detached runner, the `vllm serve`
# flags engine_args become, the JSON arguments of the engine jobs) and as environment entries (env, an engine
# variant's env). Each is refused when the config loads, before `--force` deletes anything.

def _text_keys(model=None, prefix: str = "") -> list[tuple[str, str]]:
    """(dotted key, kind) of every text-valued key of the schema: kind "path" (a file or folder), "text", "list"."""
    import typing

    from pydantic import BaseModel

    from eagle_pipeline import config as schema

    def kind_of(annotation, metadata) -> str | None:
        if any(getattr(m, "func", None) is schema._checked_path for m in metadata):
            return "path"
        if annotation is str:
            return "text"
        if typing.get_origin(annotation) is typing.Annotated and typing.get_args(annotation)[0] is str:
            return kind_of(str, typing.get_args(annotation)[1:]) or "text"
        if typing.get_origin(annotation) is list and typing.get_args(annotation) == (str,):
            return "list"
        for option in typing.get_args(annotation) if typing.get_origin(annotation) is typing.Union else ():
            if option is not type(None) and kind_of(option, ()) is not None:
                return kind_of(option, ())
        return None

    found = []
    for name, field in (model or schema.RunConfig).model_fields.items():
        options = typing.get_args(field.annotation) or (field.annotation,)
        section = next((o for o in options if isinstance(o, type) and issubclass(o, BaseModel)), None)
        if section is not None:
            found += _text_keys(section, f"{prefix}{name}.")
        elif kind_of(field.annotation, field.metadata):
            found.append((prefix + name, kind_of(field.annotation, field.metadata)))
    return found


def _nested(dotted: str, value) -> dict:
    head, _, rest = dotted.partition(".")
    return {head: _nested(rest, value) if rest else value}


# run_name names the run's folder: a file name's limits apply to it (a plain name, no '/').
TEXT_KEYS = [(key, "name" if key == "run_name" else kind) for key, kind in _text_keys()]
TEXT_DEFECTS = {"nul": ("a\x00b", "contains a NUL character"), "200kB": ("x" * 200_000, "is 200000 bytes")}
PATH_DEFECTS = {"name-300B": ("/tmp/" + "n" * 300, "has a component of 300 bytes"),
                "path-5000B": ("/tmp/" + "/".join(["p" * 200] * 25), "bytes long, above the 4095")}
NAME_DEFECTS = {"name-300B": ("n" * 300, "has a component of 300 bytes")}
ENV_DEFECTS = {"empty-name": ({"": "x"}, "a variable with an empty name"), "name-with-=": ({"A=B": "x"}, "holds '='"),
               "nul-in-name": ({"A\x00": "x"}, "contains a NUL character"), "nul-in-value": ({"A": "x\x00"}, "contains a NUL"),
               "200kB-value": ({"A": "x" * 200_000}, "is 200000 bytes"),
               "600kB-in-all": ({f"V{i}": "x" * 120_000 for i in range(5)}, "above the 524288 bytes")}
OS_CASES = (
    [(f"{key}-{d}", _nested(key, [bad] if kind == "list" else bad), key, why)
     for key, kind in TEXT_KEYS for d, (bad, why) in TEXT_DEFECTS.items()]
    + [(f"{key}-{d}", _nested(key, bad), key, why) for key, kind in TEXT_KEYS if kind in ("path", "name")
       for d, (bad, why) in (PATH_DEFECTS if kind == "path" else NAME_DEFECTS).items()]
    + [(f"env-{d}", {"env": bad}, "env", why) for d, (bad, why) in ENV_DEFECTS.items()]
    + [(f"serve.engine_variants.env-{d}", {"serve": {"engine_variants": [{"env": bad}]}}, "serve.engine_variants", why)
       for d, (bad, why) in ENV_DEFECTS.items()]
    + [(f"{key}-{d}", _nested(key, bad), key, why) for key in ("verifier.engine_args", "generation.chat_template_kwargs")
       for d, (bad, why) in {"nul-in-name": ({"a\x00": 1}, "contains a NUL"), "nul-in-value": ({"compilation_config": "\x00"}, "contains a NUL"),
                             "200kB-value": ({"compilation_config": "x" * 200_000}, "is 200000 bytes"),
                             "140kB-as-json": ({"compilation_config": {"a": "x" * 70_000, "b": "y" * 70_000}}, "bytes, above the")}.items()]
)


def test_the_generated_os_cases_reach_every_text_key():
    keys = dict(TEXT_KEYS)
    assert keys["verifier.path"] == keys["data.prompts"] == keys["data_root"] == keys["serve.drafter"] == "path"
    assert keys["generation.system_prompt"] == keys["hidden_states.mooncake.device"] == "text"
    assert keys["hidden_states.capture_endpoints"] == "list" and keys["run_name"] == "name"
    assert len(keys) >= 20 and len(OS_CASES) == len(set(c[0] for c in OS_CASES))


@pytest.mark.parametrize("case", OS_CASES, ids=[c[0] for c in OS_CASES])
def test_a_value_no_process_can_be_given_is_refused_before_force_deletes(tmp_path, capsys, case):
    name, overrides, key, expected = case
    root = tmp_path / "data"
    config = write_config(tmp_path / "run.yaml", data_root=str(root), run_name="r")
    config.write_text(yaml.safe_dump(_merge(yaml.safe_load(config.read_text()), overrides)))
    finished = fake_stage(root / "r", "06_serve_test", {"samples": 2})  # what --force would delete
    (finished / "report.json").write_text("{}")
    before = snapshot(root)
    code, _, stderr = run_stage_in_process("06_serve_test.py", config, capsys, "--force")
    lines = without_log_records(stderr)
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), f"{name}: exit {code}\n{stderr[-2000:]}"
    assert f"{key}:" in lines[0] or f"{key}." in lines[0], f"{name}: {lines[0][:300]!r} does not name {key}"
    assert expected in lines[0], f"{name}: {lines[0][:300]!r} lacks {expected!r}"
    assert len(lines[0]) < 1000, f"{name}: the error line repeats the value"
    assert snapshot(root) == before, f"{name}: files under the data root changed"


def _merge(base: dict, overlay: dict) -> dict:
    from eagle_pipeline.config.file import deep_merge

    return deep_merge(base, overlay)


# -- dry runs meet what the run meets, and say it after the plan ----------------------------------------------

def _dry_run(tmp_path, capsys, script: str, *args: str, **overrides) -> tuple[int, str, list[str]]:
    config = write_config(tmp_path / "run.yaml", data_root=str(tmp_path / "data"), run_name="r", **overrides)
    code, out, err = run_stage_in_process(script, config, capsys, "--dry-run", *args)
    return code, out, without_log_records(err)


@pytest.mark.parametrize("script", ["01_generate_data.py", "04_train.py", "06_serve_test.py"])
def test_a_dry_run_prints_its_whole_plan_then_the_gpus_the_host_lacks(tmp_path, capsys, monkeypatch, script):
    # A GPU config planned on a host without GPUs (a laptop): the plan, then one error line, exit 2.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    code, out, err = _dry_run(tmp_path, capsys, script, device="cuda")
    assert code == 2 and len(err) == 1 and err[0].startswith("error: device: cuda, but this host has no GPU"), err
    assert f"stage {script[:2]}:" in out and len(out.splitlines()) >= 3, out
    # scripts/run_pipeline.sh --dry-run plans every stage this way and says what the host lacks once, at the end.
    monkeypatch.setenv("EAGLE_DRY_RUN_HOST", "later")
    code, later_out, err = _dry_run(tmp_path, capsys, script, device="cuda")
    assert code == 0 and not err and later_out.splitlines()[0] == out.splitlines()[0]


def test_the_pipelines_dry_run_ends_with_what_the_host_lacks(tmp_path):
    import subprocess
    import sys

    config = write_config(tmp_path / "run.yaml", data_root=str(tmp_path / "data"), run_name="r", device="cuda")
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "status.py"), "--config", str(config), "--plan"],
                            capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, timeout=300)
    assert result.returncode == 2 and "| total |" in result.stdout, result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and "this host has no GPU" in result.stderr


def test_a_dry_run_of_the_mooncake_transfer_needs_mooncake_here(tmp_path, capsys, monkeypatch):
    from eagle_pipeline.online import mooncake

    monkeypatch.setattr(mooncake, "mooncake_problem", lambda: "the mooncake package is not installed")
    code, out, err = _dry_run(tmp_path, capsys, "04_train.py", hidden_states={"mode": "online", "transfer": "mooncake"})
    assert code == 2 and "online: hidden states captured live" in out, out
    assert err == ["error: hidden_states.transfer: mooncake, but the mooncake package is not installed; pip install -r "
                   "requirements/online.txt (and apt-get install libibverbs1, which its binaries load), or use transfer: file"]
    monkeypatch.setattr(mooncake, "mooncake_problem", lambda: None)
    code, _, err = _dry_run(tmp_path, capsys, "04_train.py", hidden_states={"mode": "online", "transfer": "mooncake"})
    assert code == 0 and not err


def test_a_dry_run_refuses_a_data_root_it_could_not_write(tmp_path, capsys, monkeypatch):
    import eagle_pipeline.stage as stage_module_

    root = tmp_path / "data"
    root.mkdir()
    real_access = os.access
    # A read-only mount (or another user's folder): the tests run as root, who may write anywhere else.
    monkeypatch.setattr(stage_module_.os, "access", lambda path, mode: False if Path(path) == root else real_access(path, mode))
    code, out, err = _dry_run(tmp_path, capsys, "01_generate_data.py")
    assert code == 2 and err == [f"error: data_root: cannot write under {root} ({root} is read-only for this user); choose "
                                 f"another data_root or fix permissions"], err
    assert not (root / "r").exists()


def test_force_with_dry_run_says_that_it_deletes_nothing(tmp_path, capsys):
    finished = fake_stage(tmp_path / "data" / "r", "03_build_vocab_map", {"samples": 2})
    before = snapshot(tmp_path / "data")
    code, out, _ = _dry_run(tmp_path, capsys, "03_build_vocab_map.py", "--force")
    assert code == 0 and snapshot(tmp_path / "data") == before
    assert out.splitlines()[0] == (f"note: --force with --dry-run: the dry run deletes nothing; the same command without "
                                   f"--dry-run deletes the output in {finished} (logs are kept) and redoes the stage")
