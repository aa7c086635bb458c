"""Generated bad input: every numeric field of the config schema, pushed past its range and fed wrong types.

The cases come from the schema itself (pydantic field metadata, walked recursively through every section), so
a field added later is covered without touching this file, and a field added without a range fails
`test_every_numeric_field_has_a_range`. Each bad value must raise BadInput naming the dotted field; each value
on a boundary of its range must load; every (field, value) pair is a test case of its own. A handful go through a
real stage script to check the CLI contract.
"""

from __future__ import annotations

import math
import types
import typing
from pathlib import Path

import annotated_types as at
import pytest
from conftest import run_stage, write_config
from pydantic import BaseModel

from eagle_pipeline.config import RunConfig, load_config
from eagle_pipeline.config.base import MAX_TOKENS
from eagle_pipeline.errors import BadInput


def _unwrap(annotation):
    """(type, optional) for int | float | Optional[...]; a BaseModel subclass for a nested section."""
    args = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else (annotation,)
    real = [a for a in args if a is not type(None)]
    return (real[0] if len(real) == 1 else None), type(None) in args


def numeric_fields(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[tuple[str, type, dict]]:
    """(dotted name, int or float, {"ge"/"gt"/"le"/"lt": bound}) for every numeric field, recursively."""
    found = []
    for name, info in model.model_fields.items():
        kind, _ = _unwrap(info.annotation)
        dotted = prefix + name
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            found += numeric_fields(kind, dotted + ".")
        elif kind in (int, float):
            bounds = {}
            for meta in info.metadata:
                for attr, cls in (("ge", at.Ge), ("gt", at.Gt), ("le", at.Le), ("lt", at.Lt)):
                    if isinstance(meta, cls):
                        bounds[attr] = getattr(meta, attr)
            found.append((dotted, kind, bounds))
    return found


FIELDS = numeric_fields()

# Cross-field rules the schema enforces: a boundary value of one field is valid only with these set as well.
LENGTHS = ("generation.max_tokens", "hidden_states.max_seq_len", "serve.max_tokens")
COMPANIONS = {
    "verifier.max_model_len": [f"{f}=8" for f in LENGTHS],
    **{f: [f"verifier.max_model_len={MAX_TOKENS}"] for f in LENGTHS},
    "serve.min_acceptance_length": ["serve.num_speculative_tokens=64"],
    "serve.num_speculative_tokens": ["serve.min_acceptance_length=1"],
    "data.self_written.min_words": ["data.self_written.max_words=100000"],
    "data.self_written.max_words": ["data.self_written.min_words=1"],
    # No replayed conversation leaves nothing to select checkpoints by.
    "train.predict_conversations": ["train.select_by=val_loss"],
    # A capture server's share of the GPUs is an online run's setting.
    "hidden_states.capture_gpu_memory_utilization": ["hidden_states.mode=online"],
    # The DFlash section is the DFlash family's.
    **{f"train.dflash.{key}": ["train.family=dflash"] for key in ("block_size", "num_layers", "max_anchors",
                                                                  "mask_token_id")},
}


def _fmt(value) -> str:
    if isinstance(value, float):
        return {math.inf: ".inf", -math.inf: "-.inf"}.get(value, ".nan" if math.isnan(value) else repr(value))
    return str(value)


def cases_for(kind: type, bounds: dict) -> tuple[list[str], list[str]]:
    """(bad values, boundary values that must load), as --set strings."""
    step = 1 if kind is int else None
    bad, good = ["lots", "[1, 2]", "{a: 1}", "true", "''"], []
    if kind is int:
        bad.append("1.5")
    else:
        bad += [".inf", "-.inf", ".nan"]
    lo = bounds.get("ge", bounds.get("gt"))
    hi = bounds.get("le", bounds.get("lt"))
    if "ge" in bounds:
        bad.append(_fmt(bounds["ge"] - (step or max(abs(bounds["ge"]) * 1e-3, 1e-9))))
        good.append(_fmt(bounds["ge"]))
    if "gt" in bounds:
        bad.append(_fmt(bounds["gt"]))
        good.append(_fmt(bounds["gt"] + (step or min(1e-6, (hi - lo) / 2 if hi is not None else 1e-6))))
    if "le" in bounds:
        bad.append(_fmt(bounds["le"] + (step or max(abs(bounds["le"]) * 1e-3, 1e-9))))
        good.append(_fmt(bounds["le"]))
    if "lt" in bounds:
        bad.append(_fmt(bounds["lt"]))
        good.append(_fmt(bounds["lt"] - (step or min(1e-6, (hi - lo) / 2))))
    if kind is float:
        bad.append("1e999")  # YAML reads it as a string; the schema reads it as infinity
    return bad, good


@pytest.fixture(scope="module")
def base_config(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("fuzz")
    return write_config(tmp / "c.yaml", data_root=str(tmp / "data"), run_name="fuzz")


def test_the_walk_reaches_every_section():
    names = {f[0] for f in FIELDS}
    sections = {n.split(".")[0] for n in names}
    assert {"seed", "disk_budget_gb", "train.draft_shape.hidden_size", "train.lr", "vocab.draft_vocab_size"} <= names
    assert {"verifier", "data", "generation", "hidden_states", "vocab", "train", "convert", "serve"} <= sections
    assert len(FIELDS) >= 40, len(FIELDS)


@pytest.mark.parametrize("dotted,kind,bounds", FIELDS, ids=[f[0] for f in FIELDS])
def test_every_numeric_field_has_a_range(dotted, kind, bounds):
    assert {"ge", "gt"} & set(bounds) and {"le", "lt"} & set(bounds), f"{dotted} needs a lower and an upper bound"


def generated_values() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(field, value) pairs: every bad value of every numeric field, and every boundary value that must load."""
    bad, good = [], []
    for dotted, kind, bounds in FIELDS:
        refused, accepted = cases_for(kind, bounds)
        bad += [(dotted, value) for value in refused]
        good += [(dotted, value) for value in accepted]
    return bad, good


BAD_VALUES, BOUNDARY_VALUES = generated_values()


@pytest.mark.parametrize("dotted,value", BAD_VALUES, ids=[f"{d}={v}" for d, v in BAD_VALUES])
def test_an_out_of_range_or_wrongly_typed_value_is_refused_naming_the_field(base_config, dotted, value):
    with pytest.raises(BadInput) as refused:
        load_config(base_config, [*COMPANIONS.get(dotted, []), f"{dotted}={value}"])
    message = str(refused.value)
    assert dotted in message and "\n" not in message, f"{dotted}={value}: {message}"


@pytest.mark.parametrize("dotted,value", BOUNDARY_VALUES, ids=[f"{d}={v}" for d, v in BOUNDARY_VALUES])
def test_a_value_on_the_boundary_of_its_range_loads(base_config, dotted, value):
    try:
        cfg = load_config(base_config, [*COMPANIONS.get(dotted, []), f"{dotted}={value}"])
    except BadInput as e:
        pytest.fail(f"{dotted}={value} is on the boundary of its range and must load: {e}")
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    assert math.isclose(node, float(value)), (dotted, value, node)


def test_every_field_gets_bad_and_boundary_values():
    assert {d for d, _ in BAD_VALUES} == {f[0] for f in FIELDS} == {d for d, _ in BOUNDARY_VALUES}
    assert len(BAD_VALUES) >= 8 * len(FIELDS)


# -- the same contract through a stage script -------------------------------------------------------

CLI_CASES = [
    ("negative-seed", ["seed=-1"], "seed"),
    ("nan-lr", ["train.lr=.nan"], "train.lr"),
    ("temperature-too-high", ["generation.temperature=11"], "generation.temperature"),
    ("zero-draft-heads", ["train.draft_shape.num_attention_heads=0"], "train.draft_shape.num_attention_heads"),
    ("heads-not-divisible", ["train.draft_shape.num_attention_heads=6", "train.draft_shape.num_key_value_heads=4"],
     "train.draft_shape.num_attention_heads"),
    ("generation-beyond-context", ["generation.max_tokens=5000"], "generation.max_tokens"),
    ("run-name-escapes", ["run_name=.."], "run_name"),
]


@pytest.mark.parametrize("name,sets,field", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_a_sample_through_the_cli_gets_exit_2_and_one_error_line(tmp_path, name, sets, field):
    config = write_config(tmp_path / "c.yaml", data_root=str(tmp_path / "data"), run_name="r")
    result = run_stage("01_generate_data.py", config, "--dry-run", *[a for s in sets for a in ("--set", s)])
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, f"{name}: exit {result.returncode}\n{result.stderr[-2000:]}"
    assert len(lines) == 1 and lines[0].startswith("error: ") and field in lines[0], result.stderr
    assert not (tmp_path / "data").exists()
