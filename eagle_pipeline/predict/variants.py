"""What the engine feeds the drafter, as a named variant: the as-served reference and known serving mistakes.

A sample holds stage 02's layout (docs/formats.md): `hidden_states [seq, n_aux + 1, H]`, the aux layers in
id order, then the target's final layer before its norm. At serving time vLLM feeds the drafter's `fc` only
the aux layers named by the drafter's config (the target collects them in `eagle_aux_hidden_state_layer_ids`
order); the final slot is training's target, never a drafter input, unless an engine reads id L among the
aux ids. A `Variant` says which slots the engine feeds and how it reads the drafter's config:

- `aux_slots`: indexes into the sample's slots (default: all but the last). Slots (1, .., n_aux) feed each
  aux input the next captured layer (ids (15, 27, L) for (2, 15, 27)): "one layer off" only when the sample
  holds consecutive ids, otherwise a coarser wrong-layers check. For the exact mistakes (ids one off, vLLM's
  model runner V2 capturing its default layers when the ids sit only in `eagle_config`, SGLang's minus-one
  ids read as vLLM ids) pass `samples` captured at the ids the engine would use.
- `final_slot_post_norm`: the final layer's slot with the target's final norm applied (HF's
  `hidden_states[L]` instead of vLLM's id L); it changes the prediction only when that slot is fed.
- `norm_flags`: the drafter's norm flags as the engine would read them.
- `drop_d2t`: no draft-to-target map (vLLM's identity when the folder has no `d2t`).
- `attention`: an MLA drafter's attention as the engine would compute it (`rope_interleave`, `softmax_mscale`;
  eagle_pipeline.predict.speculators_drafter); empty for a Llama-shaped drafter, which has no such reading.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

Sample = tuple[Any, "torch.Tensor", int]  # (token ids, hidden_states [seq, n_aux + 1, H], prompt length)


@dataclass(frozen=True)
class Variant:
    name: str
    aux_slots: tuple[int, ...] | None = None
    final_slot_post_norm: bool = False
    norm_flags: Mapping[str, bool] = field(default_factory=dict)
    drop_d2t: bool = False
    attention: Mapping[str, bool] = field(default_factory=dict)
    # Samples captured at other layer ids (same token ids, same order as the reference samples); None
    # uses the reference samples.
    samples: Iterable[Sample] | None = None


def serving_inputs(hidden_states: torch.Tensor, aux_slots: tuple[int, ...] | None = None,
                   final_norm: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """The aux states the engine hands the drafter, [seq, n_fed, H], from a sample's [seq, n_aux + 1, H].

    `final_norm`, when given, is applied to the sample's last slot first (the post-norm variant).
    """
    import torch

    if hidden_states.dim() != 3 or hidden_states.shape[1] < 2:
        raise ValueError(f"hidden_states shape {tuple(hidden_states.shape)}, expected [seq, n_aux + 1, H]")
    num_slots = hidden_states.shape[1]
    slots = tuple(range(num_slots - 1)) if aux_slots is None else tuple(aux_slots)
    if not slots or any(not 0 <= s < num_slots for s in slots):
        raise ValueError(f"aux slots {slots} outside the sample's {num_slots} slots")
    states = hidden_states.float()
    if final_norm is not None:
        with torch.no_grad():
            last = final_norm(states[:, -1]).to(states.dtype)
        states = torch.cat([states[:, :-1], last[:, None]], dim=1)
    return states[:, list(slots)]


def shifted_slots(num_slots: int, shift: int) -> tuple[int, ...]:
    """Aux slots moved by `shift` within a sample of consecutive ids (+1: each id one layer later)."""
    slots = tuple(s + shift for s in range(num_slots - 1))
    if any(not 0 <= s < num_slots for s in slots):
        raise ValueError(f"a shift of {shift} leaves the sample's {num_slots} slots")
    return slots


def flipped(flags: Mapping[str, bool], name: str) -> dict[str, bool]:
    return {name: not flags[name]}


def standard_variants(num_slots: int, flags: Mapping[str, bool],
                      attention: Mapping[str, bool] | None = None) -> list[Variant]:
    """The as-served reference plus the serving mistakes a stage-02 sample alone can reproduce.

    `flags` are the drafter's trained norm flags; each variant flips one. `attention`, an MLA drafter's
    (speculators_drafter.mla_attention), adds a variant flipping each of its readings. The shifted-slots variants feed
    slots 1..n_aux (the last is the final layer, pre-norm as vLLM's id L, or post-norm); they are the
    one-layer-off mistake only for consecutive ids (see the module docstring).
    """
    variants = [
        Variant("as_served"),
        Variant("d2t_dropped", drop_d2t=True),
        Variant("slots_shifted_up", aux_slots=shifted_slots(num_slots, 1)),
        Variant("slots_shifted_up_final_post_norm", aux_slots=shifted_slots(num_slots, 1), final_slot_post_norm=True),
    ]
    variants += [Variant(f"{name}_flipped", norm_flags=flipped(flags, name)) for name in flags]
    variants += [Variant(f"{name}_flipped", attention=flipped(attention, name)) for name in attention or {}]
    return variants
