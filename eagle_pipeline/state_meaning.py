"""Captured hidden states checked for meaning, not only for shape, before anything trains or replays on them, on
every sample up to `MAX_SAMPLES`, else that many spread evenly: no token's row all zero or constant in any slot,
and the final-layer slot through the target's own final norm and lm_head predicting the answer's next tokens as
the target did (`MIN_GREEDY_AGREEMENT`, `SAMPLED_NLL_FRACTION`). Why: docs/engines.md, "Hidden-state capture
through vLLM" (its "Meaning" item). The first failure is one `error:` line naming the slot (its layer) and the
sample.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle_pipeline.errors import BadInput
from eagle_pipeline.samples import flat_rows, read_sample, sample_path

MAX_SAMPLES = 8
# Rows of one sample put through lm_head: the whole answer of a short one, an even spread of a long one (a
# Kimi-K2.5 lm_head is 163,840 x 7,168: a few GFLOP per row on the CPU).
MAX_ROWS = 128
# The same target, in the same dtype, agrees with its own greedy answers on every row up to near-ties; a
# capture in another dtype than the answers were generated in flips a few of those. A zeroed final slot
# agrees with nothing, one shifted by a position or a layer on far fewer rows.
MIN_GREEDY_AGREEMENT = 0.9
# Sampled answers (temperature > 0) are the target's likely tokens: their mean negative log-likelihood sits
# far below a uniform guess's, log(vocab), which a zeroed final slot scores exactly.
SAMPLED_NLL_FRACTION = 0.5


@dataclass(frozen=True)
class TargetHead:
    """The target's final norm (RMSNorm) and lm_head: what turns its final-layer state into next-token logits."""

    norm_weight: torch.Tensor  # [H]
    eps: float
    lm_head: torch.Tensor  # [V, H]

    def logits(self, final_states: torch.Tensor) -> torch.Tensor:
        """[n, V] float32 logits from [n, H] final-layer states taken before the final norm."""
        x = final_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_weight.float()
        return (x.to(self.lm_head.dtype) @ self.lm_head.T).float()


def load_target_head(verifier_dir: str | Path, rms_norm_eps: float) -> TargetHead | None:
    """The final norm and lm_head from the target's safetensors (speculators' loader, as the replay's drafter
    uses for the same two tensors); None when the lm_head is not a plain float matrix (a quantized head)."""
    from speculators.utils.loading import load_model_layers

    verifier_dir = str(verifier_dir)
    found = load_model_layers(["model.norm.weight", "lm_head.weight"], verifier_dir)
    head = found.get("lm_head.weight")
    if head is None:  # tied embeddings: the input embedding is the head
        head = load_model_layers(["embed_tokens.weight"], verifier_dir)["embed_tokens.weight"]
    norm = found.get("model.norm.weight")
    if norm is None or not head.dtype.is_floating_point or head.dim() != 2 or norm.shape != head.shape[1:]:
        return None
    return TargetHead(norm_weight=norm, eps=float(rms_norm_eps), lm_head=head)


def target_head_for(verifier) -> TargetHead | None:
    """`load_target_head` for an `eagle_pipeline.verifier.Verifier`."""
    return load_target_head(verifier.path, verifier.text_config().get("rms_norm_eps", 1e-6))


@dataclass(frozen=True)
class CapturedSample:
    """One sample to check: its name in an error line, token ids, states [seq, slots, H], and the rows t whose
    next token x_{t+1} the target generated (the answer's)."""

    name: str
    token_ids: Sequence[int]
    hidden_states: torch.Tensor
    answer_rows: Sequence[int]


def spread(count: int, limit: int) -> list[int]:
    """Up to `limit` indices of range(count), evenly spread, first and last included."""
    if count <= limit:
        return list(range(count))
    return sorted({round(i * (count - 1) / (limit - 1)) for i in range(limit)})


def slot_names(layer_ids: Sequence[int], num_layers: int) -> list[str]:
    """How an error line names each slot of a [seq, len(layer_ids) + 1, H] sample."""
    return [f"slot {i} (layer {k})" for i, k in enumerate(layer_ids)] + [
        f"slot {len(layer_ids)} (layer {num_layers}, the final layer)"]


def check_meaning(samples: Sequence[CapturedSample], head: TargetHead | None, names: Sequence[str], *,
                  greedy: bool, fix: str) -> dict:
    """Raise BadInput (one line: the slot, the sample, the figure, `fix`) unless the states mean what they should.

    `names`: each slot's name (`slot_names`). `head`: None skips the lm_head check (a quantized head).
    Returns what was checked: {"samples", "rows", "agreement" | "mean_nll", "uniform_nll"}.
    """
    final = len(names) - 1
    checked_rows = 0
    hits = 0
    nll_sum = 0.0
    for sample in samples:
        states = sample.hidden_states
        if states.dim() != 3 or states.shape[1] != len(names):
            raise ValueError(f"{sample.name}: states of shape {tuple(states.shape)} for {len(names)} slots")
        flat = flat_rows(states)
        if flat is not None:
            row, slot = flat
            what = "all zero" if not states[row, slot].float().any() else "constant"
            raise BadInput(f"{sample.name}: {names[slot]} is {what} at token {row}: the capture did not store "
                           f"that layer's states; {fix}")
        if head is None:
            continue
        rows = [int(t) for t in sample.answer_rows]
        rows = [rows[i] for i in spread(len(rows), MAX_ROWS)]
        if not rows:
            continue
        logits = head.logits(states[rows, final])
        wanted = torch.as_tensor([int(sample.token_ids[t + 1]) for t in rows])
        if greedy:
            agree = int((logits.argmax(dim=-1) == wanted).sum())
            # One mismatch is always allowed: on a short answer a single near-tie is most of the margin.
            if len(rows) - agree > max(1, math.floor((1 - MIN_GREEDY_AGREEMENT) * len(rows))):
                raise BadInput(f"{sample.name}: {names[final]} put through the target's final norm and lm_head "
                               f"predicts {agree} of {len(rows)} answer tokens the target chose greedily (at least "
                               f"{MIN_GREEDY_AGREEMENT:.0%} expected): it does not hold the target's final layer "
                               f"at these positions; {fix}")
            hits += agree
        else:
            nll = torch.nn.functional.cross_entropy(logits, wanted, reduction="sum").item()
            uniform = math.log(logits.shape[-1])
            if nll / len(rows) > SAMPLED_NLL_FRACTION * uniform:
                raise BadInput(f"{sample.name}: {names[final]} put through the target's final norm and lm_head "
                               f"gives the answer's tokens a mean negative log-likelihood of {nll / len(rows):.2f} "
                               f"nats (a uniform guess: {uniform:.2f}; at most {SAMPLED_NLL_FRACTION * uniform:.2f} "
                               f"expected): it does not hold the target's final layer at these positions; {fix}")
            nll_sum += nll
        checked_rows += len(rows)
    result: dict = {"samples": len(samples), "rows": checked_rows}
    if head is not None and checked_rows:
        if greedy:
            result["agreement"] = round(hits / checked_rows, 4)
        else:
            result["mean_nll"] = round(nll_sum / checked_rows, 4)
            result["uniform_nll"] = round(math.log(head.lm_head.shape[0]), 4)
    return result


STAGE02_FIX = ("the engine captured wrong states; check its settings (docs/engines.md, \"Engine settings\") and rerun "
               "stage 02 with --force")


def check_stage02_samples(samples_dir: Path, rows: Sequence[dict], head: TargetHead | None, layer_ids: Sequence[int],
                          num_layers: int, *, greedy: bool, among: Sequence[int] | None = None,
                          fix: str = STAGE02_FIX) -> dict:
    """The meaning check on stage 02's stored samples: up to MAX_SAMPLES dataset rows, evenly spread over all of
    them or over the rows `among` (a batch just captured)."""
    def load(index: int) -> CapturedSample:
        row = rows[index]
        path = sample_path(samples_dir, index)
        mask = row["loss_mask"]
        answer_rows = [t for t in range(len(mask) - 1) if mask[t + 1]]
        return CapturedSample(str(path), row["input_ids"], read_sample(path)["hidden_states"], answer_rows)

    among = range(len(rows)) if among is None else among
    return check_meaning([load(among[i]) for i in spread(len(among), MAX_SAMPLES)], head,
                         slot_names(layer_ids, num_layers),
                         greedy=greedy, fix=fix)


def check_replay_states(states: Sequence[torch.Tensor], pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
                        head_loader: Callable[[], TargetHead | None], layer_ids: Sequence[int], num_layers: int, *,
                        greedy: bool, where: str) -> dict:
    """The meaning check on stage 06's captured states of the (prompt ids, answer ids) pairs it replays on."""
    picked = spread(len(pairs), MAX_SAMPLES)
    samples = [CapturedSample(f"{where}, answer {i}", list(pairs[i][0]) + list(pairs[i][1]), states[i],
                              range(len(pairs[i][0]) - 1, len(pairs[i][0]) + len(pairs[i][1]) - 1)) for i in picked]
    return check_meaning(samples, head_loader(), slot_names(layer_ids, num_layers), greedy=greedy,
                         fix=STAGE02_FIX.replace("stage 02 with --force", "stage 06"))
