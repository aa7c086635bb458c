"""hidden_states.one_pass: stage 01 captures the states while it answers, stage 02 makes its rows from them.

Stage 01 runs in this process with a stand-in for vLLM's engine that writes each answer's states where the
hidden-states connector would (named by request, with its lock file); stage 02 starts no engine in one pass. The real
engine's states are compared with a separate capture's in `test_one_pass_states_equal_a_separate_capture_per_slot`.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
import torch
from conftest import ok, run_stage, run_stage_in_process, write_config, write_smoke_config
from test_prompt_fit import Engine, run_stage_01

from eagle_pipeline.config import load_config
from eagle_pipeline.errors import BadInput
from eagle_pipeline.plan.engines import target_starts
from eagle_pipeline.samples import read_sample, sample_path

STATES, HIDDEN = 4, 576  # the embedded SmolLM2's default layers (2, 15, 27) + final, and its hidden size
PROMPT = [1, 2, 3]


def answer_to(text: str) -> list[int]:
    """The stand-in's answer to a prompt: the same on every run, one a long one (cut by a short max_seq_len)."""
    first = 10 + zlib.crc32(text.encode()) % 1000
    return [first] + list(range(20, 30)) if "chess" in text else [first, 5, 6]


class OnePassEngine(Engine):
    """Stands in for the one-pass engine: answers as `answer_to` and writes the states of prompt + answer less its
    last token to the connector's folder, as its connector does; stops the stage after `crash_after` answers."""

    def __init__(self, crash_after: int | None = None):
        super().__init__()
        self.crash_after = crash_after
        self.kwargs: dict = {}

    def module(self):
        vllm, engine = super().module(), self

        class LLM:
            llm_engine = SimpleNamespace(engine_core=SimpleNamespace())  # engine processes: nothing to step

            def __init__(self, **kwargs):
                engine.started += 1
                engine.kwargs = kwargs

        vllm.LLM = LLM
        return vllm

    def answer_in_flight(self, llm, conversations, params, **kwargs):
        assert params.extra_args == {"kv_transfer_params": {"include_output_tokens": True}}
        folder = Path(self.kwargs["kv_transfer_config"]["kv_connector_extra_config"]["shared_storage_path"])
        folder.mkdir(parents=True, exist_ok=True)
        from safetensors.torch import save_file

        for i, conversation in enumerate(conversations):
            if len(self.asked) == self.crash_after:
                raise KeyboardInterrupt
            self.asked.append(conversation[-1]["content"])
            answer = answer_to(conversation[-1]["content"])
            path = folder / f"{i}-abcdef01.safetensors"
            ids = torch.tensor(PROMPT + answer[:-1])
            save_file({"hidden_states": torch.randn(len(ids), STATES, HIDDEN), "token_ids": ids}, str(path))
            Path(f"{path}.lock").touch()
            yield i, SimpleNamespace(prompt_token_ids=PROMPT, kv_transfer_params={"hidden_states_path": str(path)},
                                     outputs=[SimpleNamespace(text="a", token_ids=answer, finish_reason="stop")])


@pytest.fixture
def one_pass_config(tmp_path) -> Path:
    return write_config(tmp_path / "run.yaml", data_root=str(tmp_path / "data"), run_name="r",
                        data={"num_samples": 5}, generation={"batch_size": 2}, hidden_states={"one_pass": True})


def records(folder: Path) -> list[dict]:
    return [json.loads(line) for part in sorted((folder / "parts").glob("part-*.jsonl"))
            for line in part.read_text().splitlines()]


def test_a_crash_keeps_every_finished_conversation_with_its_states_and_a_rerun_redoes_the_unpaired(one_pass_config):
    folder = load_config(one_pass_config).stage_dir("01_generate_data")
    crashed = OnePassEngine(crash_after=3)
    assert run_stage_01(one_pass_config, crashed) == 130
    # A part of two conversations, each with its states; the third's states wait for the part it was to join.
    assert [r["sample_id"] for r in records(folder)] == ["s000000", "s000001"]
    assert sorted(p.name for p in (folder / "states").iterdir()) == [f"hs_{i}.safetensors" for i in range(3)]
    sample_path(folder / "states", 1).unlink()  # a conversation whose states went missing
    (folder / "connector_scratch" / "7-deadbeef.safetensors.lock").touch()  # a request id of the crashed engine

    rerun = OnePassEngine()
    assert run_stage_01(one_pass_config, rerun) == 0
    # s000001 (no states) and s000002 (no conversation) again, then s000003 and s000004.
    assert rerun.asked[:2] == crashed.asked[1:] and len(rerun.asked) == 4
    done = records(folder)
    assert sorted(r["sample_id"] for r in done) == [f"s{i:06d}" for i in range(5)]  # each once
    for record in done:
        stored = read_sample(sample_path(folder / "states", int(record["sample_id"][1:])))
        assert stored["token_ids"].tolist() == record["prompt_token_ids"] + record["completion_token_ids"][:-1]
        assert stored["hidden_states"].dtype == torch.bfloat16 and stored["hidden_states"].shape[1:] == (STATES, HIDDEN)
    assert not (folder / "connector_scratch").exists()
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["inputs"]["layer_ids"] == [2, 15, 27] and manifest["inputs"]["storage_dtype"] == "bfloat16"
    assert rerun.kwargs["speculative_config"]["method"] == "extract_hidden_states"


def test_stage_02_rows_are_stage_01s_states_linked_or_cut(one_pass_config, capsys):
    assert run_stage_01(one_pass_config, OnePassEngine()) == 0
    cfg = load_config(one_pass_config)
    states = cfg.stage_dir("01_generate_data") / "states"
    with mock.patch("eagle_pipeline.state_meaning.target_head_for", return_value=None), \
            mock.patch("eagle_pipeline.capture.HiddenStateCapture", side_effect=AssertionError("an engine")):
        # (no lm_head check on the stand-in's random states; no capture engine)
        code, out, err = run_stage_in_process("02_extract_hidden.py", one_pass_config, capsys,
                                              "--set", "hidden_states.max_seq_len=8")
    assert code == 0, err[-2000:]
    from datasets import load_from_disk

    data = cfg.stage_dir("02_extract_hidden") / "data"
    rows = load_from_disk(str(data))
    cut = 0
    for i, row in enumerate(rows):
        ids, mask = row["input_ids"].tolist(), row["loss_mask"].tolist()
        source, made = sample_path(states, i), sample_path(data / "hidden_states", i)
        answer = ids[len(PROMPT):]
        assert ids[:3] == PROMPT and mask == [0, 0, 0] + [1] * len(answer)
        if len(answer) == 2:  # prompt + answer less its last token, linked to stage 01's file
            assert made.stat().st_ino == source.stat().st_ino
        else:  # cut at max_seq_len: its first tokens, written anew
            cut += 1
            assert len(ids) == 8 and made.stat().st_ino != source.stat().st_ino
            assert torch.equal(read_sample(made)["hidden_states"], read_sample(source)["hidden_states"][:8])
    assert cut == 1
    manifest = json.loads((cfg.stage_dir("02_extract_hidden") / "manifest.json").read_text())
    assert manifest["inputs"]["mode"] == "one pass"
    # Stage 03 counts every answer token a two-pass row of max_seq_len 8 would hold: the short answers' last tokens,
    # which no one-pass row holds, but not the last token of the long one, which a two-pass row cut too.
    code, _, err = run_stage_in_process("03_build_vocab_map.py", one_pass_config, capsys,
                                        "--set", "hidden_states.max_seq_len=8")
    assert code == 0, err[-2000:]
    counts = np.load(cfg.stage_dir("03_build_vocab_map") / "token_counts.npy")
    answers = load_from_disk(str(cfg.stage_dir("01_generate_data") / "conversations"))["completion_token_ids"]
    assert counts.sum() == 4 * 3 + 5 and all(counts[a[-1]] >= 1 for a in answers if len(a) == 3)

    # Rerunning stage 02 alone finds it complete; with its files gone it makes them again, still without an engine.
    for path in (data / "hidden_states").iterdir():
        path.unlink()
    with mock.patch("eagle_pipeline.state_meaning.target_head_for", return_value=None):
        code, _, err = run_stage_in_process("02_extract_hidden.py", one_pass_config, capsys,
                                            "--set", "hidden_states.max_seq_len=8")
    assert code == 0, err[-2000:]
    assert len(list((data / "hidden_states").iterdir())) == 5


def test_one_pass_refusals_name_the_key_and_the_fix(one_pass_config, tmp_path, capsys):
    with pytest.raises(BadInput, match=r"hidden_states\.one_pass: speculators 0\.9's online dataset prefills every "
                                       r"sample itself.*set mode: offline or one_pass: false"):
        load_config(one_pass_config, ["hidden_states.mode=online"])
    with pytest.raises(BadInput, match=r"generation\.dtype: bfloat16 differs from verifier\.dtype \(float32\).*"
                                       r"leave generation\.dtype unset or set one_pass false"):
        load_config(one_pass_config, ["generation.dtype=bfloat16"])
    load_config(one_pass_config, ["generation.dtype=float32"])

    # Stage 02 in one pass refuses answers made without it, or states of other layers, before writing anything.
    assert run_stage_01(one_pass_config, Engine(), "hidden_states.one_pass=false") == 0
    code, _, err = run_stage_in_process("02_extract_hidden.py", one_pass_config, capsys)
    assert code == 2 and "stage 01 answered without hidden_states.one_pass" in err and "--force (a new pass)" in err
    assert run_stage_01(one_pass_config, OnePassEngine(), "data_root=" + str(tmp_path / "b")) == 0
    code, _, err = run_stage_in_process("02_extract_hidden.py", one_pass_config, capsys, "--set",
                                        f"data_root={tmp_path / 'b'}", "--set", "hidden_states.layer_ids=[3,15,27]")
    assert code == 2 and "captured layers [2, 15, 27] as bfloat16 in one pass, the config asks for layers " \
                         "[3, 15, 27]" in err and "one_pass: false to capture them here" in err
    # A change of layer ids asks stage 01 for a new pass, named.
    engine = OnePassEngine()
    assert run_stage_01(one_pass_config, engine, f"data_root={tmp_path / 'b'}", "hidden_states.layer_ids=[3,15,27]") == 2
    assert "input 'layer_ids' changed" in capsys.readouterr().err and engine.started == 0
    # Switched to two passes, the finished one-pass answers stand as they are.
    assert run_stage_01(one_pass_config, engine, f"data_root={tmp_path / 'b'}", "hidden_states.one_pass=false") == 0
    assert "already complete" in capsys.readouterr().out and engine.started == 0


def test_stage_02_starts_no_target_in_one_pass():
    cfg = load_config(Path(__file__).parent.parent / "configs" / "tiny-one-pass.yaml")
    two_pass = load_config(Path(__file__).parent.parent / "configs" / "tiny.yaml")
    assert target_starts(cfg)["02_extract_hidden"] == 0 and target_starts(two_pass)["02_extract_hidden"] == 1
    assert sum(target_starts(cfg).values()) == sum(target_starts(two_pass).values()) - 1


# -- agreement with a separate capture, through the real engine -------------------------------------------------------

@pytest.mark.vllm
def test_one_pass_states_equal_a_separate_capture_per_slot(small_run, tmp_path):
    """Stage 01 in one pass on the shared smoke run's config answers as it did, and its states equal that run's stage
    02 capture (a separate engine, prompt + answer prefilled) on every row, per layer slot: both engines compute in
    float32 and store bf16, so each value may differ by one bf16 rounding step (relative 2**-7) where the two fp32
    values straddle a rounding boundary; the states of the answer's last token, which no forward pass ran, are not
    in one pass's."""
    config = write_smoke_config(tmp_path / "one-pass.yaml", data_root=str(tmp_path / "data"),
                                hidden_states={"one_pass": True})
    ok(run_stage("01_generate_data.py", config))
    ok(run_stage("02_extract_hidden.py", config))
    mine, theirs = load_config(config), load_config(small_run[1])
    from datasets import load_from_disk

    two = load_from_disk(str(theirs.stage_dir("01_generate_data") / "conversations"))
    one = load_from_disk(str(mine.stage_dir("01_generate_data") / "conversations"))
    assert one["completion_token_ids"] == two["completion_token_ids"]  # greedy answers, dummy draft or not
    for i in range(len(one)):
        ours = read_sample(sample_path(mine.stage_dir("02_extract_hidden") / "data" / "hidden_states", i))
        ref = read_sample(sample_path(theirs.stage_dir("02_extract_hidden") / "data" / "hidden_states", i))
        assert torch.equal(ours["token_ids"], ref["token_ids"][:-1])
        for slot in range(STATES):
            a, b = ours["hidden_states"][:, slot].float(), ref["hidden_states"][:-1, slot].float()
            assert torch.allclose(a, b, rtol=2**-7, atol=1e-6), (i, slot, (a - b).abs().max())
