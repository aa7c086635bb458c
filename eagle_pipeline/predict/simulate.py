"""Greedy speculative decoding of one conversation, replayed offline: the counts vLLM's spec-decode metrics report.

Input: the target's greedy token sequence `x_0..x_{N-1}` (prompt, then the target's greedy completion), the
target's aux hidden states `h_p` for every position (the slots the engine feeds the drafter, in id order), the
prompt length `P`, and a drafter behind the `Drafter` protocol. Output: `AcceptanceCounts`, the same numbers
vLLM's scheduler counts (`SpecDecodingStats.observe_draft`, vllm/v1/spec_decode/metrics.py:41-49).

What vLLM 0.32 does, and this module replays (line numbers in the installed vllm package):

- First draft step (`SpecDecodeBaseProposer.propose`, vllm/v1/spec_decode/llm_base_proposer.py:512-615, and
  `set_inputs_first_pass`, 817-852): the drafter runs on the target's new tokens with the target's aux
  states combined by `fc` (`combine_hidden_states`, vllm/model_executor/models/llama_eagle3.py:397-418); the
  input ids are the target's tokens shifted left by one, the last replaced by the token the target just
  sampled (844-847), at the target's positions (850). So row `p` sees `(x_{p+1}, h_p)` at position `p`, and
  the drafter's KV cache holds such a row for every position of the context. The draft from the last row
  `t` proposes `x_{t+2}`.
- Later draft steps (llm_base_proposer.py:689-768): one row per request, the previous draft token's id
  (already a target id: `compute_logits` scatters the draft logits into the target vocabulary through
  `d2t`, llama_eagle3.py:373-395) and the drafter's own hidden output of the previous step (the pre-norm
  output unless `norm_output`, llama_eagle3.py:283-288), at position `t + j` (`positions` += 1,
  `_update_positions_dependent_metadata`, 776-815), attending to the context rows and to this chain's
  earlier draft rows. `fc` is not applied again.
- Verification at temperature 0: the longest prefix of the drafts equal to the target's greedy tokens is
  accepted, the target adds its own next token (the bonus), and the next chain starts after it. The
  scheduler counts one draft per verification step with drafts, the accepted number, and accepted-per-
  position (vllm/v1/core/sched/scheduler.py:2113-2134, metrics.py:41-49); mean acceptance length is
  `1 + accepted / drafts` (metrics.py:113-114) and per-position acceptance `accepted_per_pos[i] / drafts`
  (metrics.py:116-117).

Because the context rows are the same whichever chain is being drafted (each is rebuilt from the target's
own states once the target has verified that position), every possible chain start can be drafted at once:
`draft_table` runs k steps over all rows, and `walk_chains` then follows the chains vLLM would run.
The tail of a conversation where fewer than k tokens are left to verify is left out: the engine's counts
there depend on where it stops generating, which the greedy sequence alone does not say.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


class Drafter(Protocol):
    """One draft step over a batch of rows, as the engine runs the drafter.

    Step 0 (the context pass): `input_ids` [n] are target tokens shifted by one (`x_{p+1}` in row p),
    `hidden_states` [n, n_aux, H] the target's aux states, `positions` = 0..n-1. A drafter with attention
    keeps this pass's keys and values as its context (vLLM's KV cache) and forgets any earlier sequence.
    Step j > 0: `input_ids` [n] are the previous step's draft ids, `hidden_states` [n, D] the hidden states
    it returned, `positions` = row + j; row i continues the chain drafted from context row i and attends to
    context rows 0..i and to its own earlier draft rows.
    Returns the draft token ids in the target's vocabulary [n] and the hidden states to feed back [n, D].
    """

    def draft_step(self, input_ids: torch.Tensor, hidden_states: torch.Tensor,
                   positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class AcceptanceCounts:
    """vLLM's spec-decode counters for k draft tokens (SpecDecodingStats), accumulated over conversations."""

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    num_sequences: int = 0
    # (sequence index, chain start row t, accepted) for every draft, when asked for: lets a caller compare
    # the drafts with another drafter's, or with teacher-forced accuracy, at exactly the chains counted.
    chains: list[tuple[int, int, int]] | None = None
    # How well the first draft fits the target (eagle_pipeline.predict.acceptance.add_first_draft_fit): the
    # KL of draft position 0 from the target's distribution, summed over answer rows, and the rows counted.
    first_draft_kl_sum: float = 0.0
    first_draft_kl_rows: int = 0
    # sequence index -> [drafts, accepted]: each conversation's own figures, beside the engine's per request.
    per_sequence: dict[int, list[int]] = field(default_factory=dict)

    def __post_init__(self):
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.num_speculative_tokens

    def observe_draft(self, num_accepted: int, sequence: int = 0, start: int = 0) -> None:
        """One verification step, counted as vllm/v1/spec_decode/metrics.py:41-49 does."""
        k = self.num_speculative_tokens
        assert 0 <= num_accepted <= k
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1
        tally = self.per_sequence.setdefault(sequence, [0, 0])
        tally[0] += 1
        tally[1] += num_accepted
        if self.chains is not None:
            self.chains.append((sequence, start, num_accepted))

    def summary(self) -> dict[str, Any]:
        """Acceptance figures with vLLM's definitions (metrics.py:107-117), plus the conditional rates."""
        drafts = self.num_drafts
        per_pos = [n / drafts if drafts else float("nan") for n in self.accepted_per_pos]
        reached = [drafts, *self.accepted_per_pos[:-1]]  # chains whose drafts 0..i-1 were all accepted
        conditional = [n / r if r else float("nan") for n, r in zip(self.accepted_per_pos, reached)]
        return {
            "predicted_mean_acceptance_length": 1 + self.num_accepted_tokens / drafts if drafts else float("nan"),
            "predicted_per_position_acceptance": per_pos,
            "predicted_conditional_acceptance": conditional,
            "predicted_acceptance_rate": (self.num_accepted_tokens / self.num_draft_tokens
                                          if self.num_draft_tokens else float("nan")),
            "num_drafts": drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_pos": list(self.accepted_per_pos),
            "num_sequences": self.num_sequences,
            "num_speculative_tokens": self.num_speculative_tokens,
            "first_draft_kl": (self.first_draft_kl_sum / self.first_draft_kl_rows
                               if self.first_draft_kl_rows else None),
            # Per conversation, by sequence index (None: no chain fitted in it).
            "per_sequence_mean_acceptance_length": [
                1 + self.per_sequence[i][1] / self.per_sequence[i][0] if i in self.per_sequence else None
                for i in range(self._sequence_count())],
            "per_sequence_num_drafts": [self.per_sequence.get(i, [0, 0])[0] for i in range(self._sequence_count())],
        }

    def _sequence_count(self) -> int:
        return max(self.num_sequences, max(self.per_sequence, default=-1) + 1)


@torch.no_grad()
def draft_table(drafter: Drafter, token_ids: torch.Tensor, aux_states: torch.Tensor,
                num_speculative_tokens: int) -> torch.Tensor:
    """Drafts [N-1, k]: row t holds the k tokens the engine would draft for a chain whose context ends at t.

    Row t's step-0 input is `(x_{t+1}, h_t)`; its draft j proposes `x_{t+j+2}`.
    """
    token_ids = torch.as_tensor(token_ids, dtype=torch.long)
    n = token_ids.shape[0] - 1
    if aux_states.dim() != 3 or aux_states.shape[0] != n + 1:
        raise ValueError(f"aux_states shape {tuple(aux_states.shape)}, expected [{n + 1}, n_aux, H]")
    rows = torch.arange(n)
    input_ids, hidden = token_ids[1:], aux_states[:-1]
    drafts = []
    for step in range(num_speculative_tokens):
        input_ids, hidden = drafter.draft_step(input_ids, hidden, rows + step)
        input_ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(n)
        drafts.append(input_ids)
    return torch.stack(drafts, dim=1)


def walk_chains(drafts: torch.Tensor, token_ids: Sequence[int] | torch.Tensor, prompt_len: int,
                counts: AcceptanceCounts, sequence: int = 0) -> AcceptanceCounts:
    """Follow the chains vLLM runs over one conversation and count them into `counts`.

    The first chain starts at row P-1 (the target's prefill sampled x_P, the drafter's last input there);
    after a accepted drafts and the bonus token the next starts at row t + a + 1.
    """
    k = counts.num_speculative_tokens
    tokens = torch.as_tensor(token_ids, dtype=torch.long)
    n = tokens.shape[0]
    if not 1 <= prompt_len < n:
        raise ValueError(f"prompt length {prompt_len} outside 1..{n - 1} for a sequence of {n} tokens")
    if drafts.shape != (n - 1, k):
        raise ValueError(f"drafts shape {tuple(drafts.shape)}, expected ({n - 1}, {k})")
    # matches[t, j]: draft j of the chain at row t equals the target's greedy token x_{t+j+2}.
    last_start = n - k - 2  # the last row whose k drafts all have a known token to be checked against
    if last_start < prompt_len - 1:
        counts.num_sequences += 1
        return counts
    starts = torch.arange(last_start + 1)
    wanted = tokens[starts[:, None] + 2 + torch.arange(k)[None, :]]
    matches = (drafts[: last_start + 1] == wanted).tolist()
    t = prompt_len - 1
    while t <= last_start:
        accepted = 0
        while accepted < k and matches[t][accepted]:
            accepted += 1
        counts.observe_draft(accepted, sequence, t)
        t += accepted + 1
    counts.num_sequences += 1
    return counts


def simulate_sequence(drafter: Drafter, token_ids: torch.Tensor, aux_states: torch.Tensor,
                      prompt_len: int, num_speculative_tokens: int,
                      counts: AcceptanceCounts | None = None, sequence: int = 0) -> AcceptanceCounts:
    """Draft and verify one conversation as the engine would; returns `counts` with its drafts added."""
    if counts is None:
        counts = AcceptanceCounts(num_speculative_tokens)
    drafts = draft_table(drafter, token_ids, aux_states, num_speculative_tokens)
    return walk_chains(drafts, token_ids, prompt_len, counts, sequence)
