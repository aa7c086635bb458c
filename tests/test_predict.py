"""eagle_pipeline.predict: the offline replay of vLLM's greedy speculative decoding.

(a) the chain bookkeeping, with fake drafters that need no model; (b) a drafter trained by speculators on
a tiny Llama's greedy answers, run through the replay, against speculators' own teacher-forced forward;
(c) serving-mistake variants of that drafter predict lower acceptance.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from eagle_pipeline.config import load_section
from eagle_pipeline.predict.acceptance import predict_acceptance, simulate_samples, simulate_variants
from eagle_pipeline.predict.simulate import AcceptanceCounts, draft_table, walk_chains
from eagle_pipeline.predict.speculators_drafter import SpeculatorsDrafter, load_drafter, teacher_forced_drafts
from eagle_pipeline.predict.variants import Variant
from eagle_pipeline.train import runner
from eagle_pipeline.train.settings import TrainRun

VOCAB = 512
DRAFT_VOCAB = 128
HIDDEN = 64
NUM_LAYERS = 4
LAYER_IDS = [1, 2, 3]
EPOCHS, LR = 15, 3e-3  # ~8 steps an epoch: enough for a drafter well above chance (~0.24 at position 0)


# ---------------------------------------------------------------------------------------------------
# (a) Bookkeeping, with fake drafters.


class FakeDrafter:
    """Drafts from the known greedy sequence: right at the steps (and rows) it is told to be."""

    def __init__(self, tokens: torch.Tensor, right_at_step=lambda step, rows: torch.ones_like(rows, dtype=torch.bool)):
        self.tokens, self.right_at_step, self.step = tokens, right_at_step, 0
        self.calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def draft_step(self, input_ids, hidden_states, positions):
        self.calls.append((input_ids.clone(), hidden_states.clone(), positions.clone()))
        self.step = 0 if hidden_states.dim() == 3 else self.step + 1
        rows = positions - self.step
        wanted = self.tokens[(positions + 2).clamp(max=len(self.tokens) - 1)]
        right = self.right_at_step(self.step, rows)
        drafts = torch.where(right, wanted, (wanted + 1) % VOCAB)
        return drafts, torch.zeros(len(rows), 1)


def short_sequence(n: int = 12) -> torch.Tensor:
    return torch.arange(100, 100 + n)  # distinct tokens: a draft is right only where it copies the sequence


def run_fake(drafter: FakeDrafter, tokens: torch.Tensor, prompt_len: int, k: int) -> dict:
    aux = torch.randn(len(tokens), 3, 4)
    counts = simulate_samples(drafter, [(tokens, torch.cat([aux, aux[:, :1]], dim=1), prompt_len)], k,
                              record_chains=True)
    return {**counts.summary(), "chains": counts.chains}


def test_perfect_drafter_is_always_accepted():
    tokens = short_sequence(40)
    result = run_fake(FakeDrafter(tokens), tokens, prompt_len=5, k=3)
    assert result["predicted_per_position_acceptance"] == [1.0, 1.0, 1.0]
    assert result["predicted_conditional_acceptance"] == [1.0, 1.0, 1.0]
    assert result["predicted_mean_acceptance_length"] == 4.0


def test_always_wrong_drafter_is_never_accepted():
    tokens = short_sequence(40)
    wrong = FakeDrafter(tokens, lambda step, rows: torch.zeros_like(rows, dtype=torch.bool))
    result = run_fake(wrong, tokens, prompt_len=5, k=3)
    assert result["predicted_per_position_acceptance"] == [0.0, 0.0, 0.0]
    assert result["predicted_mean_acceptance_length"] == 1.0
    # One draft per target token from the prompt's last row on (x_5 is the prefill's), none beyond the
    # last row with k tokens left to check: rows 4..40-3-2.
    assert result["num_drafts"] == 40 - 3 - 2 - 4 + 1


def test_drafter_right_only_at_step_0():
    tokens = short_sequence(40)
    first_only = FakeDrafter(tokens, lambda step, rows: torch.full_like(rows, step == 0, dtype=torch.bool))
    result = run_fake(first_only, tokens, prompt_len=5, k=3)
    assert result["predicted_per_position_acceptance"] == [1.0, 0.0, 0.0]
    # Position 2 is never reached: its conditional rate is undefined.
    conditional = result["predicted_conditional_acceptance"]
    assert conditional[:2] == [1.0, 0.0] and np.isnan(conditional[2])
    assert result["predicted_mean_acceptance_length"] == 2.0


def test_chains_restart_after_the_bonus_token():
    # 12 tokens, prompt x_0 x_1, k = 3. The first chain's context ends at row 1 (input x_2, the token the
    # prefill sampled) and drafts x_3 x_4 x_5. Wrong at step 1 of row 1 only: x_3 accepted, the target's
    # x_4 is the bonus, the next chain's context ends at row 3 and drafts x_5 x_6 x_7, all accepted, bonus
    # x_8; the next at row 7 drafts x_9 x_10 x_11, all accepted. Row 11 would need tokens past the end.
    tokens = short_sequence(12)
    drafter = FakeDrafter(tokens, lambda step, rows: ~((rows == 1) & (step == 1)))
    result = run_fake(drafter, tokens, prompt_len=2, k=3)
    assert result["chains"] == [(0, 1, 1), (0, 3, 3), (0, 7, 3)]
    assert result["num_drafts"] == 3 and result["num_accepted_tokens"] == 7
    assert result["accepted_per_pos"] == [3, 2, 2]
    assert result["predicted_per_position_acceptance"] == pytest.approx([1.0, 2 / 3, 2 / 3])
    assert result["predicted_mean_acceptance_length"] == pytest.approx(1 + 7 / 3)

    # Always wrong: a draft at every row 1..7 (each chain's bonus is the next token).
    wrong = run_fake(FakeDrafter(tokens, lambda step, rows: torch.zeros_like(rows, dtype=torch.bool)), tokens, 2, 3)
    assert [start for _, start, _ in wrong["chains"]] == list(range(1, 8))
    # Perfect: rows 1 and 5 (x_3..x_5 + bonus x_6, then x_7..x_9 + bonus x_10); row 9 has too few left.
    perfect = run_fake(FakeDrafter(tokens), tokens, 2, 3)
    assert perfect["chains"] == [(0, 1, 3), (0, 5, 3)]


def test_drafter_sees_the_engines_inputs():
    tokens = short_sequence(10)
    aux = torch.randn(10, 3, 4)
    drafter = FakeDrafter(tokens)
    drafts = draft_table(drafter, tokens, aux, 3)
    (ids0, hidden0, pos0), (ids1, hidden1, pos1), (ids2, _, pos2) = drafter.calls
    # Step 0: row p is (x_{p+1}, h_p) at position p; later steps: the previous drafts at position p + j.
    assert torch.equal(ids0, tokens[1:]) and torch.equal(hidden0, aux[:-1]) and torch.equal(pos0, torch.arange(9))
    assert torch.equal(ids1, drafts[:, 0]) and hidden1.dim() == 2 and torch.equal(pos1, torch.arange(9) + 1)
    assert torch.equal(ids2, drafts[:, 1]) and torch.equal(pos2, torch.arange(9) + 2)


def test_counts_match_vllm_definitions():
    counts = AcceptanceCounts(3)
    for accepted in (0, 3, 1, 2):
        counts.observe_draft(accepted)
    summary = counts.summary()
    assert summary["accepted_per_pos"] == [3, 2, 1]
    assert summary["predicted_per_position_acceptance"] == [0.75, 0.5, 0.25]
    assert summary["predicted_conditional_acceptance"] == pytest.approx([0.75, 2 / 3, 0.5])
    assert summary["predicted_mean_acceptance_length"] == 1 + 6 / 4
    assert summary["predicted_acceptance_rate"] == 6 / 12


def test_each_conversation_keeps_its_own_figures_as_the_engine_reports_them_per_request():
    tokens = short_sequence(40)
    perfect, wrong = FakeDrafter(tokens), FakeDrafter(tokens, lambda step, rows: torch.zeros_like(rows, dtype=torch.bool))
    counts = AcceptanceCounts(3)
    aux = torch.randn(40, 4, 4)
    for index, drafter in enumerate((perfect, wrong)):
        counts = walk_chains(draft_table(drafter, tokens, aux[:, :3], 3), tokens, 5, counts, sequence=index)
    walk_chains(torch.zeros(5, 3, dtype=torch.long), short_sequence(6), 3, counts, sequence=2)  # no chain fits
    summary = counts.summary()
    assert summary["per_sequence_mean_acceptance_length"] == [4.0, 1.0, None]
    assert summary["per_sequence_num_drafts"] == [8, 32, 0]
    assert sum(summary["per_sequence_num_drafts"]) == summary["num_drafts"]


def test_a_sequence_too_short_for_a_chain_counts_no_draft():
    tokens = short_sequence(6)
    counts = walk_chains(torch.zeros(5, 3, dtype=torch.long), tokens, 3, AcceptanceCounts(3))
    assert counts.num_drafts == 0 and counts.num_sequences == 1


# ---------------------------------------------------------------------------------------------------
# (b), (c) A trained drafter.


def greedy_sequences(model, count: int, prompt_len: int, answer_len: int, seed: int) -> list[tuple[torch.Tensor, int]]:
    """Random prompts followed by the target's greedy answer, generated as one batch with the KV cache.

    Each is cut at the first token that is not the argmax of a forward over the whole sequence (the
    forward the hidden states are captured with), should rounding ever split a near tie.
    """
    tokens = torch.randint(0, VOCAB, (count, prompt_len), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        out = model(tokens, use_cache=True)
        for _ in range(answer_len):
            next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, next_ids], dim=1)
            out = model(next_ids, past_key_values=out.past_key_values, use_cache=True)
        greedy = model(tokens).logits.argmax(-1)
    sequences = []
    for row, seq in zip(greedy, tokens):
        wrong = (row[prompt_len - 1:-1] != seq[prompt_len:]).nonzero()
        sequences.append((seq[: prompt_len + int(wrong[0])] if len(wrong) else seq, prompt_len))
    return sequences


def capture(model, tokens: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """hidden_states [seq, len(ids) + 1, H] in stage 02's layout: the ids' states, then the pre-norm final."""
    captured = {}
    hook = model.model.norm.register_forward_pre_hook(lambda module, args: captured.update(pre_norm=args[0]))
    try:
        with torch.no_grad():
            out = model(tokens[None], output_hidden_states=True)
    finally:
        hook.remove()
    return torch.stack([out.hidden_states[k][0] for k in layer_ids] + [captured["pre_norm"][0]], dim=1)


def write_data(data_dir: Path, samples: list[tuple[torch.Tensor, torch.Tensor, int]]) -> None:
    from datasets import Dataset
    from safetensors.torch import save_file

    (data_dir / "hidden_states").mkdir(parents=True)
    rows = {"input_ids": [], "loss_mask": [], "seq_len": []}
    for row, (tokens, hidden, prompt_len) in enumerate(samples):
        save_file({"hidden_states": hidden.to(torch.bfloat16).contiguous(), "token_ids": tokens},
                  str(data_dir / "hidden_states" / f"hs_{row}.safetensors"))
        rows["input_ids"].append(tokens.tolist())
        rows["loss_mask"].append([0] * prompt_len + [1] * (len(tokens) - prompt_len))
        rows["seq_len"].append(len(tokens))
    dataset = Dataset.from_dict(rows)
    dataset.set_format("torch")
    dataset.save_to_disk(str(data_dir))


def write_vocab_map(folder: Path, samples) -> tuple[Path, Path]:
    """Stage 03's rule: the most frequent answer tokens, padded with the lowest unused ids, ascending."""
    counts = np.zeros(VOCAB, dtype=np.int64)
    for tokens, _, prompt_len in samples:
        np.add.at(counts, tokens[prompt_len:].numpy(), 1)
    order = sorted(range(VOCAB), key=lambda t: (-counts[t], t))
    ids = np.sort(np.array(order[:DRAFT_VOCAB]))
    t2d = np.zeros(VOCAB, dtype=bool)
    t2d[ids] = True
    np.save(folder / "d2t.npy", (ids - np.arange(DRAFT_VOCAB)).astype(np.int64))
    np.save(folder / "t2d.npy", t2d)
    return folder / "d2t.npy", folder / "t2d.npy"


def build_case(root: Path, epochs: int, lr: float) -> dict:
    """A tiny Llama target, its greedy answers and their states, and a drafter speculators trained on them."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=NUM_LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False)
    target = LlamaForCausalLM(config).eval()
    target.save_pretrained(root / "verifier")
    sequences = greedy_sequences(target, count=24, prompt_len=10, answer_len=48, seed=1)
    samples = [(tokens, capture(target, tokens, LAYER_IDS), p) for tokens, p in sequences]
    # The same conversations captured one layer earlier (ids 0, 1, 2): what an engine reading the ids one
    # off would feed.
    shifted_down = [(tokens, capture(target, tokens, [k - 1 for k in LAYER_IDS]), p) for tokens, p in sequences]
    write_data(root / "data", samples)
    d2t, t2d = write_vocab_map(root, samples)
    settings = load_section("train", dict(total_seq_len=256, lr=lr, num_workers=0, keep_last=1, val_ratio=0.1,
                                          threads=1, dtype="float32", epochs=epochs,
                                          # the last checkpoint is used: no selection, no replay per epoch
                                          select_by="val_loss", predict_conversations=0), source="test settings")
    run = TrainRun(data_dir=root / "data", d2t_path=d2t, t2d_path=t2d, verifier_dir=root / "verifier",
                   out_dir=root / "04_train", layer_ids=LAYER_IDS, seed=0, storage_dtype="bfloat16", device="cpu")
    summary = runner.train_drafter(settings, run)
    # The samples as the drafter was trained on them: bf16-rounded, as stored.
    def stored(items):
        return [(tokens, hidden.to(torch.bfloat16).float(), p) for tokens, hidden, p in items]

    model = load_drafter(root / "04_train" / summary["last"]["checkpoint"])
    return {"model": model, "samples": stored(samples), "shifted_down": stored(shifted_down), "target": target}


@pytest.fixture(scope="module")
def trained_case(tmp_path_factory) -> dict:
    return build_case(tmp_path_factory.mktemp("predict_case"), epochs=EPOCHS, lr=LR)


def test_greedy_samples_are_the_targets_greedy_answers(trained_case):
    target = trained_case["target"]
    for tokens, _, prompt_len in trained_case["samples"][:3]:
        with torch.no_grad():
            greedy = target(tokens[None]).logits[0].argmax(-1)
        assert torch.equal(greedy[prompt_len - 1:-1], tokens[prompt_len:])


def test_step_0_matches_training_and_later_steps_match_where_the_chain_is_right(trained_case):
    model, samples, k = trained_case["model"], trained_case["samples"], 3
    result = predict_acceptance(model, samples, k, record_chains=True)
    assert result["num_drafts"] > 100
    drafter = SpeculatorsDrafter(model)
    served_rows = agree_rows = 0
    later_total = later_agree = 0
    chain_hits = []
    chains_by_sample: dict[int, list[tuple[int, int]]] = {}
    for sample, start, accepted in result["chains"]:
        chains_by_sample.setdefault(sample, []).append((start, accepted))
    for index, (tokens, hidden, prompt_len) in enumerate(samples):
        aux = hidden[:, :-1]
        served = draft_table(drafter, tokens, aux, k)
        forced = teacher_forced_drafts(model, tokens, aux, ttt_steps=k)
        # Step 0 sees exactly the training inputs: the same drafts at every row.
        served_rows += len(served)
        agree_rows += int((served[:, 0] == forced[:, 0]).sum())
        # A later step agrees with teacher forcing wherever the chain's earlier drafts were right.
        rows = torch.arange(len(tokens) - 1)
        for step in range(1, k):
            valid = rows + step + 1 < len(tokens)
            wanted = tokens[(rows[:, None] + 2 + torch.arange(step)[None]).clamp(max=len(tokens) - 1)]
            right_so_far = (served[:, :step] == wanted).all(dim=1) & valid
            later_total += int(right_so_far.sum())
            later_agree += int((served[right_so_far, step] == forced[right_so_far, step]).sum())
        # Teacher-forced step-0 accuracy at the chain starts the replay counted.
        for start, _ in chains_by_sample.get(index, []):
            chain_hits.append(bool(forced[start, 0] == tokens[start + 2]))
    assert agree_rows / served_rows > 0.99
    assert later_total > 50 and later_agree / later_total > 0.98
    forced_accuracy = sum(chain_hits) / len(chain_hits)
    assert len(chain_hits) == result["num_drafts"]
    assert result["predicted_per_position_acceptance"][0] == pytest.approx(forced_accuracy, abs=0.02)
    # The drafter learned something: far above a guess among 128 draft tokens.
    assert result["predicted_per_position_acceptance"][0] > 0.15


def test_serving_mistakes_predict_lower_acceptance(trained_case):
    model, samples, k = trained_case["model"], trained_case["samples"], 3
    variants = [Variant("as_served"), Variant("d2t_dropped", drop_d2t=True),
                Variant("slots_shifted_up", aux_slots=(1, 2, 3)),
                Variant("ids_shifted_down", samples=trained_case["shifted_down"]),
                Variant("final_post_norm_unfed", final_slot_post_norm=True)]
    results = simulate_variants(model, iter(samples), k, variants)
    served = results["as_served"]["predicted_mean_acceptance_length"]
    assert served == pytest.approx(predict_acceptance(model, samples, k)["predicted_mean_acceptance_length"])
    predicted = {name: result["predicted_mean_acceptance_length"] for name, result in results.items()}
    # Without d2t almost every draft is a wrong token; states of other layers cost less, as adjacent
    # layers of a residual stream are alike (cosine ~0.85 in this target).
    assert predicted["d2t_dropped"] < 1.05 < served - 0.3, predicted
    assert predicted["ids_shifted_down"] < served - 0.1, predicted
    assert predicted["slots_shifted_up"] < served, predicted
    # The final slot is never a drafter input with the trained slots: its norm changes nothing.
    assert results["final_post_norm_unfed"]["predicted_mean_acceptance_length"] == served


def test_default_variants_run(trained_case):
    model, samples = trained_case["model"], trained_case["samples"][:4]
    results = simulate_variants(model, samples, 2)
    assert {"as_served", "d2t_dropped", "slots_shifted_up", "slots_shifted_up_final_post_norm",
            "norm_before_residual_flipped", "norm_before_fc_flipped", "fc_norm_flipped",
            "norm_output_flipped"} == set(results)
    for name, result in results.items():
        assert len(result["predicted_per_position_acceptance"]) == 2, name
        assert result["num_drafts"] > 0 and result["variant"]["name"] == name
    # Feeding the final slot post-norm is a different input from feeding it pre-norm.
    assert (results["slots_shifted_up_final_post_norm"]["accepted_per_pos"]
            != results["slots_shifted_up"]["accepted_per_pos"]
            or results["slots_shifted_up_final_post_norm"]["num_drafts"] != results["slots_shifted_up"]["num_drafts"])
