"""The stage folder protocol: skip finished work, refuse mixed inputs, --force, atomic writes."""

import json
import os

import pytest
from conftest import write_config

from eagle_pipeline import atomic
from eagle_pipeline.config import load_config
from eagle_pipeline.errors import BadInput
from eagle_pipeline.stage import Stage, Start, check_disk, read_manifest


@pytest.fixture
def cfg(tmp_path):
    return load_config(write_config(tmp_path / "c.yaml", data_root=str(tmp_path / "root"), run_name="r"))


def test_manifest_fields_and_skip_when_complete(cfg):
    stage = Stage(3, cfg, force=False)
    assert stage.start({"a": "1"}) is Start.STARTED
    assert read_manifest(stage.dir)["status"] == "running"
    stage.finish({"samples": 4}, output_fingerprint="x")
    manifest = read_manifest(stage.dir)
    for field in ("stage", "status", "config", "inputs", "counts", "started_at", "finished_at", "versions"):
        assert field in manifest
    assert manifest["status"] == "complete" and manifest["stage"] == "03_build_vocab_map"
    assert manifest["versions"]["speculators"] == "0.9.0"
    assert (stage.dir / "config.yaml").exists()
    assert Stage(3, cfg, force=False).start({"a": "1"}) is Start.ALREADY_COMPLETE


def test_changed_input_is_refused_and_named(cfg):
    stage = Stage(3, cfg, force=False)
    stage.start({"tokenizer": "aaa", "layer_ids": [2, 15, 27]})
    stage.finish({}, output_fingerprint="x")
    with pytest.raises(BadInput, match=r"input 'layer_ids' changed .* rerun with --force"):
        Stage(3, cfg, force=False).start({"tokenizer": "aaa", "layer_ids": [2, 14, 27]})
    # an unfinished stage with other inputs is refused as well: its partial output must not be mixed
    stage2 = Stage(2, cfg, force=False)
    stage2.start({"verifier": "v1"})
    with pytest.raises(BadInput, match=r"input 'verifier' changed"):
        Stage(2, cfg, force=False).start({"verifier": "v2"})


def test_begin_names_a_changed_input_then_runs_the_stages_checks_before_writing(cfg):
    ran = []

    def refuse():
        ran.append("checks")
        raise BadInput("checkpoint: no weights")

    stage = Stage(3, cfg, force=False)
    with pytest.raises(BadInput, match="no weights"):
        stage.begin({"a": "1"}, before_writing=refuse)
    assert ran == ["checks"] and not stage.dir.exists(), "a refusal of the stage's checks writes nothing"
    assert stage.begin({"a": "1"}, before_writing=lambda: ran.append("checks")) is Start.STARTED
    stage.finish({}, output_fingerprint="x")
    again = Stage(3, cfg, force=False)
    assert again.begin({"a": "1"}, before_writing=refuse) is Start.ALREADY_COMPLETE and again.inputs == {"a": "1"}
    with pytest.raises(BadInput, match=r"input 'a' changed"):  # named before the stage's own checks
        Stage(3, cfg, force=False).begin({"a": "2"}, before_writing=refuse)
    assert ran == ["checks", "checks"]


def test_force_removes_old_output(cfg):
    stage = Stage(3, cfg, force=False)
    stage.start({"a": "1"})
    (stage.dir / "old.bin").write_bytes(b"x")
    (stage.dir / "logs").mkdir()
    (stage.dir / "logs" / "03_build_vocab_map.log").write_text("earlier run")
    stage.finish({}, output_fingerprint="x")
    assert Stage(3, cfg, force=True).start({"a": "2"}) is Start.STARTED
    assert not (stage.dir / "old.bin").exists()
    assert (stage.dir / "logs" / "03_build_vocab_map.log").read_text() == "earlier run", "logs survive --force"


def test_sample_count_up_resumes_and_down_is_refused(cfg):
    stage = Stage(1, cfg, force=False)
    stage.start({"a": "1"}, samples=10)
    stage.finish({"samples": 10}, output_fingerprint="x")
    assert Stage(1, cfg, force=False).start({"a": "1"}, samples=10) is Start.ALREADY_COMPLETE
    assert Stage(1, cfg, force=False).start({"a": "1"}, samples=20) is Start.STARTED
    stage.finish({"samples": 10}, output_fingerprint="x")
    with pytest.raises(BadInput, match=r"sample count went down from 10 to 5"):
        Stage(1, cfg, force=False).start({"a": "1"}, samples=5)


def test_atomic_write_keeps_old_file_when_writer_fails(tmp_path):
    target = tmp_path / "f.json"
    atomic.write_json(target, {"v": 1})

    def failing(tmp):
        tmp.write_text("partial")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        atomic.write_with(target, failing)
    assert json.loads(target.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"], "the torn temporary is removed"


def test_sweep_removes_torn_temporaries(tmp_path):
    (tmp_path / (atomic.TMP_PREFIX + "hs_3.safetensors.abc")).write_bytes(b"torn")
    (tmp_path / "hs_2.safetensors").write_bytes(b"done")
    assert atomic.sweep_temporaries(tmp_path) == 1
    assert os.listdir(tmp_path) == ["hs_2.safetensors"]


def test_disk_check_refuses_with_numbers(tmp_path):
    with pytest.raises(BadInput, match=r"needs about .* GB but only .* GB is free"):
        check_disk(tmp_path, 10**18, "hidden states")
    check_disk(tmp_path, 1, "hidden states")


def test_finished_stage_records_its_files_and_each_check_kind(cfg):
    from safetensors.torch import save_file

    from eagle_pipeline import outputs

    stage = Stage(4, cfg, force=False)
    stage.start({"a": "1"})
    (stage.dir / "small.json").write_text('{"x": 1}')
    (stage.dir / "big.bin").write_bytes(os.urandom(outputs.HASH_LIMIT + 1))
    (stage.dir / "w").mkdir()
    import torch

    save_file({"t": torch.zeros(outputs.HASH_LIMIT // 4 + 1)}, str(stage.dir / "w" / "model.safetensors"))
    (stage.dir / "logs").mkdir()
    (stage.dir / "logs" / "x.log").write_text("not an output")
    stage.finish({}, output_fingerprint="x")
    recorded = {e["path"]: e for e in read_manifest(stage.dir)["outputs"]}
    assert sorted(recorded) == ["big.bin", "small.json", "w/model.safetensors"]  # no logs, manifest or config.yaml
    assert [recorded[p]["check"] for p in sorted(recorded)] == ["ends", "sha256", "safetensors"]
    assert outputs.damaged_outputs(stage.dir, list(recorded.values())) == []


@pytest.mark.parametrize("damage", ["delete", "same-size-edit", "torn-weights", "weights-header"])
def test_damaged_output_is_named_removed_and_redone_not_trusted_as_complete(cfg, damage):
    from safetensors.torch import save_file

    from eagle_pipeline.stage import require_complete

    stage = Stage(3, cfg, force=False)
    stage.start({"a": "1"})
    (stage.dir / "d2t.npy").write_bytes(b"0123456789")
    import torch

    weights = stage.dir / "model.safetensors"
    save_file({"t": torch.zeros(2**19)}, str(weights))  # 2 MiB: checked by its header, not hashed
    stage.finish({}, output_fingerprint="x")
    target = weights if "weights" in damage else stage.dir / "d2t.npy"
    if damage == "delete":
        target.unlink()
    elif damage == "same-size-edit":
        target.write_bytes(b"0123456780")
    elif damage == "torn-weights":
        target.write_bytes(target.read_bytes()[:-8])
    else:
        data = bytearray(target.read_bytes())
        data[:8] = b"\xff" * 8
        target.write_bytes(bytes(data))
    with pytest.raises(BadInput, match=rf"{target}: .*since stage 03_build_vocab_map finished; rerun 03_build_vocab_map\.py"):
        require_complete(cfg, 3)
    assert not Stage(3, cfg, force=False).already_complete({"a": "1"})
    untouched = {p.name: p.stat().st_mtime_ns for p in stage.dir.iterdir() if p.is_file() and p != target}
    assert Stage(3, cfg, force=False).start({"a": "1"}) is Start.STARTED
    assert not target.exists(), "the damaged file is removed, for the stage to make it again"
    assert read_manifest(stage.dir)["status"] == "running"
    assert {n: t for n, t in untouched.items() if n not in ("manifest.json", "config.yaml")} == \
        {p.name: p.stat().st_mtime_ns for p in stage.dir.iterdir() if p.is_file() and p.name not in ("manifest.json", "config.yaml")}


def test_malformed_outputs_record_is_refused_naming_the_fix(cfg):
    stage = Stage(3, cfg, force=False)
    stage.start({"a": "1"})
    stage.finish({}, output_fingerprint="x")
    manifest = read_manifest(stage.dir)
    manifest["outputs"] = [{"path": "../../etc/passwd", "size": 1, "check": "sha256", "digest": "0"}]
    (stage.dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BadInput, match=r"manifest `outputs\[0\]` is not a .*rerun that stage \(03_build_vocab_map\.py\) with --force"):
        read_manifest(stage.dir)
