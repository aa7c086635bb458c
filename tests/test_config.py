"""The config schema: every shipped config validates; bad keys and values get one-line errors."""

from pathlib import Path

import pytest
import yaml
from conftest import REPO, write_config

from eagle_pipeline.config import load_config
from eagle_pipeline.errors import BadInput

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_validates_and_says_what_it_is_for(path: Path):
    cfg = load_config(path)
    assert cfg.run_name and cfg.data.num_samples >= 1
    first = path.read_text().splitlines()[0]
    assert first.startswith("# ") and path.stem in first, "each config starts with a comment naming what it is for"
    assert "Run:" in path.read_text().split("\n\n")[0], "the header says how to run it"


def test_unknown_top_level_key_is_named(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", run_nmae="x")
    with pytest.raises(BadInput, match=r"unknown key 'run_nmae' in the top level"):
        load_config(cfg)


def test_misspelt_nested_key_is_named_with_its_section(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", train={"epohcs": 3})
    with pytest.raises(BadInput, match=r"unknown key 'epohcs' in section 'train'"):
        load_config(cfg)


def test_wrong_type_names_the_field(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", data={"num_samples": "many"})
    with pytest.raises(BadInput, match=r"data\.num_samples"):
        load_config(cfg)


def test_missing_required_value_says_how_to_set_it(tmp_path):
    path = tmp_path / "c.yaml"
    data = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    del data["vocab"]["draft_vocab_size"]
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(BadInput, match=r"vocab\.draft_vocab_size is required; set it .* --set vocab\.draft_vocab_size="):
        load_config(path)


def test_extends_a_missing_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("extends: nowhere.yaml\n")
    with pytest.raises(BadInput, match=r"nowhere\.yaml: config file not found \(extended by"):
        load_config(path)


def test_extends_overlays_and_set_overrides_are_typed(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", data={"num_samples": 12})
    loaded = load_config(cfg, ["train.epochs=7", "hidden_states.layer_ids=[3, 9, 20]"])
    assert loaded.data.num_samples == 12
    assert loaded.data.eval_prompts == "data/prompts_eval.jsonl"  # inherited from tiny.yaml
    assert loaded.train.epochs == 7
    assert loaded.hidden_states.layer_ids == [3, 9, 20]


def test_set_of_unknown_key_is_an_error(tmp_path):
    with pytest.raises(BadInput, match=r"unknown key 'bogus' in section 'train'"):
        load_config(write_config(tmp_path / "c.yaml"), ["train.bogus=1"])


def test_duplicate_layer_ids_are_refused(tmp_path):
    with pytest.raises(BadInput, match=r"hidden_states\.layer_ids.*duplicates"):
        load_config(write_config(tmp_path / "c.yaml", hidden_states={"layer_ids": [2, 2, 9]}))


def test_invalid_yaml_names_the_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("run_name: x\ndata: [unclosed\n")
    with pytest.raises(BadInput, match=r"c\.yaml line \d+: not valid YAML"):
        load_config(path)


def test_config_fingerprint_changes_with_any_value(tmp_path):
    base = load_config(write_config(tmp_path / "c.yaml"))
    other = load_config(write_config(tmp_path / "c.yaml"), ["generation.max_tokens=7"])
    assert base.fingerprint() != other.fingerprint()


def test_prompt_files_have_unique_ids_and_share_no_prompt():
    import json

    def rows(name):
        return [json.loads(line) for line in (REPO / "data" / name).read_text().splitlines() if line.strip()]

    train, held_out = rows("prompts_train.jsonl"), rows("prompts_eval.jsonl")
    for group in (train, held_out):
        assert len({r["id"] for r in group}) == len(group)
        assert len({r["prompt"] for r in group}) == len(group)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    assert load_config(REPO / "configs" / "tiny.yaml").data.num_samples <= len(train)
