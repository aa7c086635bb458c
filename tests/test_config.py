"""The config schema: every shipped config validates; bad keys and values get one-line errors."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, stage_module, write_config

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



def test_the_kimi_acceptance_floor_holds_from_1k_samples_and_the_smoke_run_passes_when_served_as_predicted():
    """A drafter trained on 10 samples accepts ~1.3: under the 2.0 floor of the larger scales stage 06 would exit 1
    on a run that worked. The smoke run's floor lets it pass when served as predicted, and still fails it when
    served short of its prediction."""
    floors = {path.name: load_config(path).serve.min_acceptance_length
              for path in CONFIGS if path.name.startswith("kimi-k2.5")}
    assert floors.pop("kimi-k2.5-10.yaml") == 1.0
    assert set(floors.values()) == {2.0}, floors  # the base, 1k, 10k, fine-tunes and online runs
    verdict = stage_module("06_serve_test.py").verdict
    served = {"mean_acceptance_length": 1.3, "speedup": 1.02,
              "diagnosis": {"passed": True, "cause_text": None}}
    smoke = load_config(REPO / "configs" / "kimi-k2.5-10.yaml").serve.min_acceptance_length
    assert verdict(served, smoke)[0] and not verdict(served, floors["kimi-k2.5-1k.yaml"])[0]
    short = {**served, "predicted_mean_acceptance_length": 1.8,
             "diagnosis": {"passed": False, "cause_text": "the engine"}}
    ok, message = verdict(short, smoke)
    assert not ok and "does not serve the drafter as it was trained" in message

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


# -- config files an adversarial user hands in ------------------------------------------------------


def test_non_utf8_byte_names_the_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(f"extends: {REPO / 'configs' / 'tiny.yaml'}\nrun_name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(BadInput, match=r"c\.yaml line 2: byte 0xe9 is not UTF-8; save the file as UTF-8"):
        load_config(path)


@pytest.mark.parametrize("value,expected", [
    ("[a.yaml, b.yaml]", r"extends: expected one base file name, got \['a.yaml', 'b.yaml'\]"),
    ("{x: 1}", r"extends: expected one base file name"),
    ("''", r"extends: expected one base file name"),
    (".", r"extends: .* is a folder; name a \.yaml file"),
])
def test_extends_must_name_one_file(tmp_path, value, expected):
    path = tmp_path / "c.yaml"
    path.write_text(f"extends: {value}\nrun_name: x\n")
    with pytest.raises(BadInput, match=expected):
        load_config(path)


def test_config_that_is_a_folder_or_a_symlink_loop(tmp_path):
    with pytest.raises(BadInput, match=r"--config names a folder; name a \.yaml file"):
        load_config(tmp_path)
    (tmp_path / "a.yaml").symlink_to(tmp_path / "b.yaml")
    (tmp_path / "b.yaml").symlink_to(tmp_path / "a.yaml")
    with pytest.raises(BadInput, match=r"a\.yaml: --config cannot be resolved"):
        load_config(tmp_path / "a.yaml")


@pytest.mark.parametrize("text,kind", [("- a\n- b\n", "list"), ("just words\n", "str"), ("42\n", "int")])
def test_config_that_is_not_a_mapping(tmp_path, text, kind):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(BadInput, match=rf"a config must be a YAML mapping of keys to values, not a {kind}"):
        load_config(path)


def test_repeated_section_is_refused_naming_key_and_lines(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(f"extends: {REPO / 'configs' / 'tiny.yaml'}\ntrain:\n  epochs: 2\nseed: 1\ntrain:\n  lr: 0.1\n")
    with pytest.raises(BadInput, match=r"c\.yaml line 5: key 'train' appears again \(first at line 2\)"):
        load_config(path)


def test_repeated_nested_key_is_refused_too(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(f"extends: {REPO / 'configs' / 'tiny.yaml'}\ntrain: {{epochs: 2, epochs: 3}}\n")
    with pytest.raises(BadInput, match=r"key 'epochs' appears again"):
        load_config(path)


def test_yaml_merge_keys_still_work(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(f"extends: {REPO / 'configs' / 'tiny.yaml'}\n"
                    "serve: &shared {temperature: 0.5, max_tokens: 20}\n"
                    "generation:\n  <<: *shared\n  max_tokens: 30\n")
    cfg = load_config(path)
    assert cfg.generation.temperature == 0.5 and cfg.generation.max_tokens == 30


def test_a_typo_in_a_base_is_blamed_on_the_base(tmp_path):
    (tmp_path / "base.yaml").write_text(f"extends: {REPO / 'configs' / 'tiny.yaml'}\ntrain:\n  epohcs: 2\n")
    (tmp_path / "child.yaml").write_text("extends: base.yaml\nseed: 3\n")
    with pytest.raises(BadInput, match=r"base\.yaml: unknown key 'epohcs' in section 'train'") as refused:
        load_config(tmp_path / "child.yaml")
    assert "child.yaml" not in str(refused.value)


def test_a_bad_value_from_set_is_blamed_on_set(tmp_path):
    with pytest.raises(BadInput, match=r"^--set train\.lr=5: train\.lr: Input should be less than or equal to 1"):
        load_config(write_config(tmp_path / "c.yaml"), ["train.lr=5"])


@pytest.mark.parametrize("name", ["..", ".", "/etc", "a/b", "a\\b", "a\x00b", "", "  "])
def test_run_name_must_stay_inside_data_root(tmp_path, name):
    with pytest.raises(BadInput, match=r"run_name: "):
        load_config(write_config(tmp_path / "c.yaml", run_name=name))


def test_empty_data_root_is_refused(tmp_path):
    with pytest.raises(BadInput, match=r"data_root: must not be empty"):
        load_config(write_config(tmp_path / "c.yaml", data_root=""))


@pytest.mark.parametrize("overrides,expected", [
    (["generation.max_tokens=1280"], r"generation\.max_tokens: 1280 must be below verifier\.max_model_len \(1280\)"),
    (["verifier.max_model_len=1024"], r"hidden_states\.max_seq_len: 1024 must be below verifier\.max_model_len \(1024\)"),
    (["serve.max_tokens=2000"], r"serve\.max_tokens: 2000 must be below verifier\.max_model_len"),
    (["train.draft_shape={num_attention_heads: 6, num_key_value_heads: 4}"],
     r"train\.draft_shape\.num_attention_heads: 6 is not a multiple of num_key_value_heads \(4\)"),
    (["serve.min_acceptance_length=4.5"], r"serve\.min_acceptance_length: 4\.5 can never be reached"),
    (["seed=true"], r"seed: expected a number, got true"),
    (["verifier.path=/models/a\x00b"], r"verifier\.path: contains a NUL character"),
    # A DFlash drafter (train.family: dflash) has none of EAGLE-3's layer settings; its own section needs the family.
    (["train.family=dflash", "train.draft_layer=mla"], r"train\.draft_layer: an EAGLE-3 setting, but train\.family "
                                                       r"is dflash: .*DFlashQwen3ForCausalLM"),
    (["train.family=dflash", "train.draft_shape={num_hidden_layers: 2}"], r"train\.draft_shape: .*dflash\.num_layers"),
    (["train.family=dflash", "train.norm_before_fc=false"], r"train\.norm_before_fc: an EAGLE-3 setting"),
    (["train.family=dflash", "train.norm_output=false"], r"train\.norm_output: an EAGLE-3 setting"),
    (["train.family=dflash", "train.ttt_steps=4"], r"train\.ttt_steps: .*dflash\.block_size"),
    (["train.dflash={block_size: 4}"], r"train\.dflash: applies to train\.family dflash only"),
    (["train.family=dflash", "train.dflash.block_size=1"], r"train\.dflash\.block_size: Input should be greater"),
])
def test_cross_field_and_type_rules(tmp_path, overrides, expected):
    with pytest.raises(BadInput, match=expected):
        load_config(write_config(tmp_path / "c.yaml"), overrides)


def test_unknown_engine_arg_is_named_with_the_closest_valid_one(tmp_path):
    from eagle_pipeline.config.vllm_names import vllm_engine_arg_names

    if vllm_engine_arg_names() is None:
        pytest.skip("vLLM is not installed: engine_args cannot be checked")
    assert {"enforce_eager", "max_num_seqs", "gpu_memory_utilization"} <= vllm_engine_arg_names()
    with pytest.raises(BadInput, match=r"verifier\.engine_args\.enforce_eagr: not a vLLM engine argument; did you mean 'enforce_eager'\?"):
        load_config(write_config(tmp_path / "c.yaml"), ["verifier.engine_args.enforce_eagr=true"])
    assert load_config(write_config(tmp_path / "c.yaml"), ["verifier.engine_args.max_num_seqs=4"])


@pytest.mark.parametrize(("key", "owner"), [("model", "verifier.path"), ("seed", "seed"), ("max_model_len", "verifier.max_model_len"),
                                            ("tensor_parallel_size", "verifier.tensor_parallel_size"),
                                            ("kv_cache_dtype", "verifier.kv_cache_dtype"), ("enforce_eager", "verifier.enforce_eager")])
def test_engine_args_cannot_set_what_a_config_key_owns(tmp_path, key, owner):
    with pytest.raises(BadInput, match=rf"verifier\.engine_args\.{key}: is set by {re.escape(owner)}"):
        load_config(write_config(tmp_path / "c.yaml"), [f"verifier.engine_args.{key}=1"])


def test_engine_settings_are_checked_against_vllm(tmp_path):
    from eagle_pipeline.config.vllm_names import vllm_attention_backends

    if vllm_attention_backends() is None:
        pytest.skip("vLLM is not installed: attention backends cannot be checked")
    config = write_config(tmp_path / "c.yaml")
    with pytest.raises(BadInput, match=r"verifier\.attention_backend: 'TRITON_MLAA' is not a vLLM attention backend; did you mean 'TRITON_MLA'\?"):
        load_config(config, ["verifier.attention_backend=TRITON_MLAA"])
    with pytest.raises(BadInput, match=r"serve\.drafter_kv_cache_dtype: 'fp9' is not a vLLM KV-cache dtype"):
        load_config(config, ["serve.drafter_kv_cache_dtype=fp9"])
    cfg = load_config(config, ["verifier.attention_backend=TRITON_MLA", "verifier.kv_cache_dtype=fp8",
                               "serve.drafter_attention_backend=TRITON_MLA"])
    assert (cfg.verifier.attention_backend, cfg.verifier.kv_cache_dtype, cfg.serve.drafter_attention_backend) == (
        "TRITON_MLA", "fp8", "TRITON_MLA")


def test_checking_vllm_names_does_not_import_vllm(tmp_path):
    # Every config load (dry runs included) checks the names against vLLM's source; importing vLLM would cost seconds.
    config = write_config(tmp_path / "c.yaml", verifier={"engine_args": {"max_num_seqs": 4},
                                                         "attention_backend": "TRITON_MLA", "kv_cache_dtype": "fp8"})
    code = ("import sys; from eagle_pipeline.config import load_config; load_config(sys.argv[1]); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch')))")
    result = subprocess.run([sys.executable, "-c", code, str(config)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout[-500:] + result.stderr[-2000:]


@pytest.mark.parametrize("key", sorted(__import__("eagle_pipeline.config.verifier", fromlist=["x"]).ENGINE_ARGS_REFUSED))
def test_engine_args_that_swap_the_targets_weights_config_or_tokenizer_are_refused(tmp_path, key):
    # Each is a real engine argument (so the refusal is this rule, not the spelling check), refused naming why.
    from eagle_pipeline.config.verifier import ENGINE_ARGS_REFUSED
    from eagle_pipeline.config.vllm_names import vllm_engine_arg_names

    assert vllm_engine_arg_names() is None or key in vllm_engine_arg_names()
    with pytest.raises(BadInput, match=rf"verifier\.engine_args\.{key}: {re.escape(ENGINE_ARGS_REFUSED[key][:30])}.*remove it"):
        load_config(write_config(tmp_path / "c.yaml", verifier={"engine_args": {key: "dummy"}}))


@pytest.mark.parametrize(("env", "expected"), [
    ({"": "x"}, r"env: a variable with an empty name"),
    ({"A=B": "x"}, r"env: variable name 'A=B' holds '='"),
    ({"A\x00": "x"}, r"env: the name 'A\\x00' contains a NUL character"),
    ({"A": "x\x00y"}, r"env: 'A' contains a NUL character"),
    ({"A": "x" * 200_000}, r"env: 'A' is 200000 bytes, above the 131071 bytes one command-line argument"),
    ({"A": "x" * 131_070}, r"env: A: is 131072 bytes"),  # A=value is the entry the kernel counts
    ({f"V{i}": "x" * 120_000 for i in range(5)}, r"env: 5 variables of \d+ bytes in all, above the 524288"),
])
def test_env_the_os_would_refuse_is_refused_at_load_naming_the_key(tmp_path, env, expected):
    with pytest.raises(BadInput, match=expected):
        load_config(write_config(tmp_path / "c.yaml", env=env))


def test_env_at_the_os_limits_loads_and_a_process_starts_with_it(tmp_path):
    import subprocess
    import sys

    cfg = load_config(write_config(tmp_path / "c.yaml", env={"A": "x" * (131_071 - 2), "B": "é" * 100}))
    out = subprocess.run([sys.executable, "-c", "import os; print(len(os.environ['A']))"], env={**cfg.env},
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "131069"


@pytest.mark.parametrize(("text", "expected"), [
    ("run_name: 2024-06-01\n", r'run_name: YAML read the unquoted value as a date \(2024-06-01\), not text; quote it, e.g. run_name: "2024-06-01"'),
    ("run_name: off\n", r"run_name: YAML read the unquoted value as the boolean false \(as it reads off, no and false\), not text; quote it"),
    ("env: {A: 1}\n", r'env\.A: YAML read the unquoted value as the number 1, not text; quote it, e.g. A: "1"'),
    ("env: {A: 0.5}\n", r"env\.A: YAML read the unquoted value as the number 0\.5, not text; quote it"),
    ("env: {7: a}\n", r"env: YAML read the unquoted name 7 as the number 7, not text; quote it"),
])
def test_text_that_yaml_typed_says_quote_it(tmp_path, text, expected):
    path = tmp_path / "c.yaml"
    path.write_text(f"extends: {REPO / 'configs' / 'tiny.yaml'}\n{text}")
    with pytest.raises(BadInput, match=expected) as error:
        load_config(path)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(("base", "override", "expected"), [
    ({}, "verifier.max_model_len=200", r"^--set verifier\.max_model_len=200: generation\.max_tokens: 256 must be below"),
    ({"train": {"num_gpus": 1, "fsdp_shard": True}}, "train.num_gpus=0", r"^--set train\.num_gpus=0: train\.fsdp_shard: needs GPUs"),
    ({"serve": {"min_acceptance_length": 3.5}}, "serve.num_speculative_tokens=2",
     r"^--set serve\.num_speculative_tokens=2: serve\.min_acceptance_length: 3\.5 can never be reached"),
])
def test_a_cross_field_error_blames_the_set_that_caused_it_not_the_base(tmp_path, base, override, expected):
    config = write_config(tmp_path / "c.yaml", **base)
    load_config(config)  # the file alone loads
    with pytest.raises(BadInput, match=expected):
        load_config(config, [override])


def test_a_cross_field_error_of_the_file_alone_still_blames_the_file(tmp_path):
    config = write_config(tmp_path / "c.yaml", train={"num_gpus": 0, "fsdp_shard": True})
    with pytest.raises(BadInput, match=rf"^{re.escape(str(config))}: train\.fsdp_shard: needs GPUs"):
        load_config(config, ["train.epochs=2"])


def test_a_duplicate_engine_variant_is_refused_naming_its_index(tmp_path):
    variants = [{"verifier.enforce_eager": False}, {"verifier.model_runner": "v1"}, {"verifier.enforce_eager": False}]
    with pytest.raises(BadInput, match=r"serve\.engine_variants: entry 2 repeats entry 0, and each entry is served with a "
                                       r"cold start of the target; remove one"):
        load_config(write_config(tmp_path / "c.yaml", serve={"engine_variants": variants}))
    assert len(load_config(write_config(tmp_path / "c.yaml", serve={"engine_variants": variants[:2]})).serve.engine_variants) == 2


def test_an_engine_variants_env_is_checked_like_the_runs(tmp_path):
    with pytest.raises(BadInput, match=r"serve\.engine_variants: entry 0: env: variable name 'X=1' holds '='"):
        load_config(write_config(tmp_path / "c.yaml", serve={"engine_variants": [{"env": {"X=1": "a"}}]}))


def test_a_capture_endpoints_password_is_never_printed_or_recorded(tmp_path):
    from eagle_pipeline.config import dump_config
    from eagle_pipeline.config.base import redact_url
    from eagle_pipeline.online.session import plan_lines

    assert redact_url("http://me:s3cret@10.0.0.5:8000/v1") == "http://me:***@10.0.0.5:8000/v1"
    assert redact_url("http://10.0.0.5:8000/v1") == "http://10.0.0.5:8000/v1"
    url = "http://me:s3cret@10.0.0.5:8000/v1"
    cfg = load_config(write_config(tmp_path / "c.yaml", hidden_states={"mode": "online", "capture_endpoints": [url]}))
    assert cfg.hidden_states.capture_endpoints == [url]  # the run itself still has it
    recorded = [dump_config(cfg), str(cfg.model_dump(mode="json")), "\n".join(plan_lines(cfg, 4, 576, 1024))]
    assert all("s3cret" not in text and "me:***@10.0.0.5:8000" in text for text in recorded)
    with pytest.raises(BadInput, match=r"'http://me:\*\*\*@10\.0\.0\.5:99999/v1': its port is not a number from 1 to 65535") as error:
        load_config(write_config(tmp_path / "c.yaml", hidden_states={"mode": "online",
                                                                     "capture_endpoints": ["http://me:s3cret@10.0.0.5:99999/v1"]}))
    assert "s3cret" not in str(error.value)


def test_a_dflash_drafter_takes_speculators_defaults_and_eagle3_runs_record_no_new_setting(tmp_path):
    from eagle_pipeline.train.settings import recorded_settings

    eagle = load_config(write_config(tmp_path / "c.yaml"))
    # Runs finished before the family existed keep their recorded inputs, so they stay complete.
    assert not {"train.family", "train.dflash"} & set(recorded_settings(eagle.train))
    dflash = load_config(write_config(tmp_path / "c.yaml"), ["train.family=dflash"])
    assert dflash.train.dflash.model_dump() == {"block_size": 8, "num_layers": 5, "max_anchors": 512,
                                                "mask_token_id": None}
    recorded = recorded_settings(dflash.train)
    assert recorded["train.family"] == "dflash" and "train.dflash" not in recorded
    changed = load_config(write_config(tmp_path / "c.yaml"), ["train.family=dflash", "train.dflash.block_size=4"])
    assert recorded_settings(changed.train)["train.dflash"]["block_size"] == 4
