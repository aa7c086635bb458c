"""Online training's logic, without engines (the real thing, capture servers and Mooncake included, is in
tests/test_online_vllm.py): its config keys, the capture connectors and server arguments, speculators' flags,
the checks of a capture server (against a stand-in HTTP server), the kept validation rows, the peak watch, a
capture server's failure named, the GPU memory plan, and the CPU connector patch's fingerprints."""

from __future__ import annotations

import importlib
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from conftest import write_config

from eagle_pipeline.capture import kv_transfer_config
from eagle_pipeline.config import load_config
from eagle_pipeline.errors import BadInput
from eagle_pipeline.online import failure, kept, servers, settings
from eagle_pipeline.online import memory as memory_plan
from eagle_pipeline.online.disk import PeakWatch, sample_bytes, window_bound
from eagle_pipeline.online.endpoints import ExpectedCapture, check_endpoint, probe_endpoint
from eagle_pipeline.online.servers import capture_label, parse_label
from eagle_pipeline.online.session import plan_lines
from eagle_pipeline.samples import sample_path, write_sample
from patches import speculators_capture_stop
from patches.upstream import source_sha256

# ---------------------------------------------------------------- config keys


def _load(tmp_path, **hidden_states):
    return load_config(write_config(tmp_path / "c.yaml", data_root=str(tmp_path / "d"), run_name="t",
                                    hidden_states=hidden_states))


def test_offline_is_the_default_and_online_keys_load(tmp_path):
    assert _load(tmp_path).hidden_states.mode == "offline"
    cfg = _load(tmp_path, mode="online", transfer="mooncake", online_window=4, capture_retry_s=60,
                capture_endpoints=["http://10.0.0.5:8000/v1"], mooncake={"master": "10.0.0.5:50051", "store_gib": 8})
    assert cfg.hidden_states.capture_endpoints == ["http://10.0.0.5:8000/v1"]
    assert cfg.hidden_states.mooncake.master == "10.0.0.5:50051"


@pytest.mark.parametrize("keys,message", [
    ({"transfer": "fp8"}, r"hidden_states\.transfer: fp8 quantizes states in flight.*storage_dtype: fp8"),
    ({"transfer": "mooncake"}, r"hidden_states\.mode: offline stores the states.*set mode: online"),
    ({"capture_endpoints": ["http://h:1/v1"]}, r"hidden_states\.mode: offline"),
    ({"capture_gpu_memory_utilization": 0.8}, r"hidden_states\.mode: offline"),
    ({"mode": "online", "storage_dtype": "fp8"}, r"hidden_states\.storage_dtype: online stores no states.*transfer: fp8"),
    ({"mode": "online", "capture_endpoints": ["http://h/v1"]}, r"capture_endpoints: 'http://h/v1' must be a server's base URL with its port"),
    ({"mode": "online", "capture_endpoints": ["ftp://h:1"]}, r"capture_endpoints: 'ftp://h:1' must be"),
    ({"mode": "online", "capture_endpoints": ["http://h:1/v1", "http://h:1/v1"]}, r"capture_endpoints: names a server twice"),
    ({"mode": "online", "mooncake": {"master": "h:1"}}, r"hidden_states\.mooncake: a Mooncake master is set but transfer is file"),
    ({"mode": "online", "transfer": "mooncake", "mooncake": {"master": "nohost"}}, r"mooncake\.master: 'nohost' must be host:port"),
    ({"mode": "online", "transfer": "mooncake", "mooncake": {"master": "h:70000"}}, r"mooncake\.master: 'h:70000' must be host:port"),
    ({"mode": "online", "online_window": 0}, r"hidden_states\.online_window"),
    ({"mode": "sometimes"}, r"hidden_states\.mode"),
])
def test_online_keys_are_refused_naming_the_key(tmp_path, keys, message):
    with pytest.raises(BadInput, match=message):
        _load(tmp_path, **keys)


# ---------------------------------------------------------------- the capture connectors and server


@pytest.mark.parametrize("transfer,device,connector,module", [
    ("file", "cpu", "CpuHiddenStatesConnector", "patches.cpu_hidden_states_connector"),
    ("file", "cuda", "ExampleHiddenStatesConnector", None),
    ("fp8", "cpu", "CpuFp8HiddenStatesConnector", "patches.cpu_hs_connectors"),
    ("fp8", "cuda", "FP8HiddenStatesConnector", "hs_connectors.fp8_hidden_states_connector"),
    ("mooncake", "cpu", "CpuMooncakeHiddenStatesConnector", "patches.cpu_hs_connectors"),
    ("mooncake", "cuda", "MooncakeHiddenStatesConnector", "hs_connectors.mooncake_hidden_states_connector"),
])
def test_each_transfer_has_its_connector_on_each_device(tmp_path, transfer, device, connector, module):
    store = {"master_server_address": "h:1"}
    config = kv_transfer_config(tmp_path, device, transfer, store)
    assert config["kv_connector"] == connector and config["kv_role"] == "kv_producer"
    assert config.get("kv_connector_module_path") == module
    expected_extra = {"mooncake": store} if transfer == "mooncake" else {"shared_storage_path": str(tmp_path)}
    assert config["kv_connector_extra_config"] == expected_extra


def test_a_connector_without_its_destination_is_refused(tmp_path):
    with pytest.raises(ValueError, match="Mooncake connector needs the store's settings"):
        kv_transfer_config(None, "cpu", "mooncake")
    with pytest.raises(ValueError, match="fp8 connector needs a storage path"):
        kv_transfer_config(None, "cpu", "fp8")


def test_capture_server_flags(tmp_path):
    from eagle_pipeline.online.servers import capture_server_kwargs

    cfg = _load(tmp_path, mode="online")
    kwargs = capture_server_kwargs(cfg, speculative_config={"method": "extract_hidden_states"},
                                   kv_transfer_config={"kv_connector": "X"}, served_model_names=["/m", "eagle-capture;a=b"],
                                   max_model_len=70, listen_host="0.0.0.0")
    flags = kwargs["extra_args"]
    assert kwargs["max_model_len"] == 70 and kwargs["speculative_config"] == {"method": "extract_hidden_states"}
    assert json.loads(flags[flags.index("--kv-transfer-config") + 1]) == {"kv_connector": "X"}
    assert "--no-enable-prefix-caching" in flags
    assert flags[flags.index("--served-model-name") + 1:flags.index("--served-model-name") + 3] == ["/m", "eagle-capture;a=b"]
    assert flags[flags.index("--max-num-batched-tokens") + 1] == "70"
    assert flags[-2:] == ["--host", "0.0.0.0"]  # after serve_flags' own --host: the one that counts
    # As many sequences as the ranks ask for at once (window 2 x 1 rank here), and no CUDA graphs, even where the
    # config's own engines use them (configs/tiny.yaml sets enforce_eager: passed once).
    assert flags[flags.index("--max-num-seqs") + 1] == "2" and flags.count("--enforce-eager") == 1
    graphs = load_config(write_config(tmp_path / "k.yaml", data_root=str(tmp_path / "d"), run_name="t",
                                      verifier={"enforce_eager": False}, train={"num_gpus": 8},
                                      hidden_states={"mode": "online", "online_window": 3}))
    eager = capture_server_kwargs(graphs, speculative_config={}, kv_transfer_config={}, served_model_names=["/m"],
                                  max_model_len=70)["extra_args"]
    assert eager[eager.index("--max-num-seqs") + 1] == "24" and eager.count("--enforce-eager") == 1
    sized = capture_server_kwargs(load_config(write_config(tmp_path / "e.yaml", data_root=str(tmp_path / "d"), run_name="t",
                                                           verifier={"engine_args": {"max_num_batched_tokens": 512}})),
                                  speculative_config={}, kv_transfer_config={}, served_model_names=["/m"], max_model_len=70)
    assert sized["extra_args"].count("--max-num-batched-tokens") == 1  # verifier.engine_args' own, not ours
    seqs = capture_server_kwargs(load_config(write_config(tmp_path / "s.yaml", data_root=str(tmp_path / "d"), run_name="t",
                                                          verifier={"engine_args": {"max_num_seqs": 5}})),
                                 speculative_config={}, kv_transfer_config={}, served_model_names=["/m"], max_model_len=70)
    assert seqs["extra_args"].count("--max-num-seqs") == 1  # verifier.engine_args' own
    gpu = load_config(write_config(tmp_path / "g.yaml", data_root=str(tmp_path / "d"), run_name="t", device="cuda",
                                   verifier={"gpu_memory_utilization": 0.9},
                                   hidden_states={"mode": "online", "capture_gpu_memory_utilization": 0.8}))
    shared = capture_server_kwargs(gpu, speculative_config={}, kv_transfer_config={}, served_model_names=["/m"],
                                   max_model_len=70)["extra_args"]
    # The capture server's share comes after the served target's own, and the last one counts.
    assert shared.index("0.9") < len(shared) - 1 - shared[::-1].index("--gpu-memory-utilization")
    assert shared[len(shared) - shared[::-1].index("--gpu-memory-utilization")] == "0.8"


def test_a_restarted_capture_server_asks_for_what_is_free_then(tmp_path, monkeypatch):
    from eagle_pipeline.online import servers

    gib = memory_plan.GIB
    assert servers.share_free_now(0.80, int(70 * gib), int(100 * gib)) == 0.68  # less its CUDA context, rounded down
    assert servers.share_free_now(0.80, int(95 * gib), int(100 * gib)) == 0.80  # never more than planned
    assert servers.share_free_now(0.80, None, None) == 0.80  # nothing read: as planned
    gpu = load_config(write_config(tmp_path / "g.yaml", data_root=str(tmp_path / "d"), run_name="t", device="cuda",
                                   hidden_states={"mode": "online", "capture_gpu_memory_utilization": 0.8}))
    assert memory_plan.capture_share(gpu) == 0.8 and servers.free_share_reader(_load(tmp_path, mode="online")) is None

    class Server:  # a VllmServer that dies once, then stays up
        def __init__(self):
            self.extra_args, self.started, self.code = ["--gpu-memory-utilization", "0.8"], [], None

        def start(self):
            self.started.append(list(self.extra_args))
            self.code = 1 if len(self.started) == 1 else None

        def returncode(self):
            return self.code

        def stop(self):
            pass

    fake = Server()
    monkeypatch.setattr(servers.CaptureServer, "_new_server", lambda self: fake)
    with servers.CaptureServer({}, tmp_path / "log", port=1, poll_s=0.01, restart_share=lambda: 0.61) as server:
        deadline = time.monotonic() + 10
        while len(fake.started) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert server.restarts == 1 and fake.started[0] == ["--gpu-memory-utilization", "0.8"]
    assert fake.started[1][-2:] == ["--gpu-memory-utilization", "0.61"]  # the last one counts


def test_a_capture_server_takes_the_gpu_locks_the_stages_take(tmp_path, capsys):
    from eagle_pipeline import locks
    from eagle_pipeline.online import serve_capture

    config = write_config(tmp_path / "c.yaml", data_root=str(tmp_path / "d"), run_name="t", device="cuda",
                          env={"CUDA_VISIBLE_DEVICES": "3"}, hidden_states={"mode": "online"})
    before = dict(os.environ)  # the server applies the run's engine environment to its own process
    try:
        os.environ[locks.GPU_LOCK_DIR_VARIABLE] = str(tmp_path / "locks")
        with locks.HeldLocks() as held:  # stage 06 of another run on GPU 3
            os.environ["CUDA_VISIBLE_DEVICES"] = "3"
            locks.take_gpu_locks(locks.holder_record(run="other", stage="06_serve_test"), held)
            os.environ["CUDA_VISIBLE_DEVICES"] = "9"  # the config's env picks GPU 3 again
            assert serve_capture.main(["--config", str(config)]) == 2
    finally:
        os.environ.clear()
        os.environ.update(before)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "gpu-3.lock: held by run 'other' stage 06_serve_test" in err[0]
    assert "GPU 3 is in use by another pipeline job" in err[0]


# ---------------------------------------------------------------- speculators' flags


def test_request_retries_cover_each_round_trips_share_of_the_retry_time():
    for retry_s in (1, 8, 30, 120, 300, 3600):
        retries = settings.request_retries(retry_s)
        waits = [settings.RETRY_BACKOFF_BASE ** a for a in range(1, retries + 1)]
        share = retry_s / (1 + settings.ROUND_TRIP_RETRIES)
        assert sum(waits) >= share and (retries == 1 or sum(waits[:-1]) < share), (retry_s, retries)


def test_the_window_is_the_loader_processes_or_the_trainer_itself():
    assert settings.loader_workers(1) == 0 and settings.loader_workers(4) == 4


def test_with_flags_replaces_given_values_and_appends_the_rest():
    argv = ["--on-missing", "raise", "--num-workers", "0", "--seed", "1"]
    assert settings.with_flags(argv, {"--on-missing": "generate", "--vllm-endpoint": "http://h:1/v1"}) == [
        "--on-missing", "generate", "--num-workers", "0", "--seed", "1", "--vllm-endpoint", "http://h:1/v1"]


def test_speculators_reads_the_online_flags_as_its_online_dataset_settings(tmp_path):
    """The flags go through speculators' own config resolution: each rank its endpoint, the backend's own flags."""
    from speculators.train.config import TrainConfig

    online = settings.OnlineTraining(endpoints=["http://a:1/v1", "http://b:2/v1"], transfer="mooncake", window=3,
                                     retry_s=120, mooncake={"master_server_address": "m:50051", "metadata_server": "P2PHANDSHAKE",
                                                            "protocol": "tcp", "device_name": "", "global_segment_size": 0,
                                                            "local_buffer_size": 2**28})
    base = ["--verifier-name-or-path", str(tmp_path), "--data-path", str(tmp_path), "--draft-vocab-size", "8",
            "--hidden-states-backend", "file", "--on-missing", "raise", "--num-workers", "0"]
    for rank, endpoint in ((0, "http://a:1/v1"), (1, "http://b:2/v1"), (2, "http://a:1/v1")):
        resolved = TrainConfig.resolve(settings.with_flags(base, settings.speculators_flags(online, rank)))
        assert resolved.generation.vllm_endpoint == endpoint
        assert resolved.generation.on_missing == "generate"
        assert resolved.generation.max_retries == settings.request_retries(120)
        assert resolved.generation.max_consecutive_generation_failures == 1
        assert resolved.data.hidden_states_backend == "mooncake" and resolved.data.num_workers == 3
        assert resolved._backend_args["mooncake_master"] == "m:50051"
        assert resolved._backend_args["mooncake_global_segment_gib"] == 0


def test_a_train_run_carries_its_online_settings_through_launch_json(tmp_path):
    from eagle_pipeline.train.settings import TrainRun

    online = settings.OnlineTraining(endpoints=["http://a:1/v1"], transfer="file", window=2, retry_s=30)
    run = TrainRun(data_dir=tmp_path, d2t_path=tmp_path / "d", t2d_path=tmp_path / "t", verifier_dir=tmp_path,
                   out_dir=tmp_path, layer_ids=[1], seed=0, storage_dtype="bfloat16", device="cpu", online=online)
    again = TrainRun(**json.loads(json.dumps(run.to_json())))
    assert again.online == online
    assert TrainRun(**{**run.to_json(), "online": None}).online is None


# ---------------------------------------------------------------- checking a capture server


LABEL = parse_label(capture_label(target="f" * 64, capture_ids=[2, 15, 27, 30], transfer="file", hidden_size=576,
                                  engine="e" * 64))


def test_a_label_says_what_a_server_captures():
    assert LABEL == {"target": "f" * 16, "layers": "2,15,27,30", "transfer": "file", "hidden": "576", "engine": "e" * 16}
    assert parse_label("/models/smollm2") is None


class _FakeVllm(BaseHTTPRequestHandler):
    models: list = []
    metrics: str = ""

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path == "/metrics":
            body = self.metrics.encode()
        else:
            body = json.dumps({"object": "list", "data": self.models}).encode()
        self.send_response(200 if self.path in ("/v1/models", "/metrics") else 404)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_server():
    """A stand-in that answers /v1/models with `handler.models`; yields (endpoint, handler class)."""
    handler = type("Handler", (_FakeVllm,), {"models": [], "metrics": ""})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/v1", handler
    server.shutdown()


def test_prefill_counters_and_the_mooncake_masters_gauges_are_read_from_prometheus_text(fake_server):
    from eagle_pipeline.online.mooncake import read_metrics
    from eagle_pipeline.online.servers import capture_metrics

    endpoint, handler = fake_server
    # Two engines (data-parallel) sum; the buckets, the _created gauge and a longer name that starts alike do not.
    handler.metrics = """\
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 600.0
vllm:prompt_tokens_total{engine="1",model_name="m"} 400.0
# TYPE vllm:prompt_tokens_created gauge
vllm:prompt_tokens_created{engine="0",model_name="m"} 1.795950067497156e+09
# TYPE vllm:prompt_tokens_total_cached counter
vllm:prompt_tokens_total_cached{engine="0",model_name="m"} 7.0
# TYPE vllm:request_prefill_time_seconds histogram
vllm:request_prefill_time_seconds_bucket{engine="0",le="+Inf",model_name="m"} 3.0
vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 3.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 1.5
vllm:request_prefill_time_seconds_count{engine="1",model_name="m"} 2.0
vllm:request_prefill_time_seconds_sum{engine="1",model_name="m"} 0.5
"""
    assert capture_metrics(endpoint) == {"prompt_tokens": 1000.0, "prefill_seconds": 2.0, "requests": 5.0}
    # As the master of mooncake-transfer-engine 0.3.13 answers.
    handler.metrics = """\
# HELP master_allocated_bytes Total memory bytes currently allocated across all segments
# TYPE master_allocated_bytes gauge
master_allocated_bytes 4096
# HELP master_total_capacity_bytes Total memory capacity across all mounted segments
# TYPE master_total_capacity_bytes gauge
master_total_capacity_bytes 1073741824
# TYPE master_exist_key_requests_total counter
master_exist_key_requests_total 0
"""
    values = read_metrics(endpoint.removesuffix("/v1") + "/metrics")
    assert (values["master_allocated_bytes"], values["master_total_capacity_bytes"]) == (4096, 2**30)


def _label(**changes) -> str:
    fields = {**LABEL, **changes}
    return ";".join(["eagle-capture", *(f"{k}={v}" for k, v in fields.items())])


EXPECTED = ExpectedCapture(served_model="/models/smollm2", label=LABEL, longest_sequence=60)


def test_a_capture_server_of_this_run_passes(fake_server):
    endpoint, handler = fake_server
    handler.models = [{"id": "/models/smollm2", "max_model_len": 61}, {"id": _label(), "max_model_len": 61}]
    assert check_endpoint(endpoint, EXPECTED)["label"] == LABEL


@pytest.mark.parametrize("models,message", [
    ([{"id": "/elsewhere/smollm2"}], r"serves '/elsewhere/smollm2' first, but the trainer asks for '/models/smollm2'.*--served-model-name"),
    ([{"id": "/models/smollm2"}], r"has no capture label .*not started as a capture server"),
    ([{"id": "/models/smollm2"}, {"id": _label(layers="1,15,27,30")}],
     r"captures layers '1,15,27,30' but this run needs '2,15,27,30' \(hidden_states\.layer_ids\)"),
    ([{"id": "/models/smollm2"}, {"id": _label(transfer="mooncake")}], r"captures transfer 'mooncake' but this run needs 'file'"),
    ([{"id": "/models/smollm2"}, {"id": _label(target="0" * 16)}], r"captures target '0{16}' but .*\(verifier\.path\)"),
    ([{"id": "/models/smollm2"}, {"id": _label(engine="0" * 16)}], r"captures engine .*verifier\.dtype"),
    ([{"id": "/models/smollm2", "max_model_len": 40}, {"id": _label()}], r"takes sequences of up to 39 tokens but .* has 60"),
])
def test_a_mismatched_capture_server_is_refused_in_one_line_naming_it(fake_server, models, message):
    endpoint, handler = fake_server
    handler.models = models
    with pytest.raises(BadInput, match=message) as refused:
        check_endpoint(endpoint, EXPECTED)
    assert endpoint in str(refused.value) and "\n" not in str(refused.value)
    assert str(refused.value).startswith("hidden_states.capture_endpoints: ")


def test_a_capture_server_that_does_not_answer_is_named():
    with pytest.raises(BadInput, match=r"capture_endpoints: http://127\.0\.0\.1:9/v1 does not answer as a vLLM server"):
        check_endpoint("http://127.0.0.1:9/v1", EXPECTED, timeout=2)


class _Client:
    endpoint = "http://h:1/v1"

    def __init__(self, sample=None, params=None, error=None):
        self.sample, self.params, self.error = sample, params, error

    def capture(self, ids):
        if self.error:
            raise self.error
        return self.sample, self.params


def test_the_probe_checks_what_arrives_and_how():
    ids = [5, 6, 7]
    good = {"hidden_states": torch.zeros(3, 4, 8), "token_ids": torch.tensor(ids)}
    seconds, params = probe_endpoint(_Client(good, {"hidden_states_path": "/x"}), ids, num_states=4, hidden_size=8, transfer="file")
    assert seconds >= 0 and params == {"hidden_states_path": "/x"}
    manifest = {"handle": "k", "version": 1, "tensors": {}, "metadata": {}}
    probe_endpoint(_Client(good, manifest), ids, num_states=4, hidden_size=8, transfer="mooncake")
    with pytest.raises(BadInput, match=r"answered with a file path, but this run's transfer is mooncake"):
        probe_endpoint(_Client(good, {"hidden_states_path": "/x"}), ids, num_states=4, hidden_size=8, transfer="mooncake")
    with pytest.raises(BadInput, match=r"captured states of shape \[3, 4, 8\], expected \[3, 3, 8\]"):
        probe_endpoint(_Client(good, {"hidden_states_path": "/x"}), ids, num_states=3, hidden_size=8, transfer="file")
    with pytest.raises(BadInput, match=r"h:1/v1 did not deliver a sample through transfer file \(RuntimeError: gone\)"):
        probe_endpoint(_Client(error=RuntimeError("gone")), ids, num_states=4, hidden_size=8, transfer="file")


# ---------------------------------------------------------------- kept rows, the view, the replay's reader


def test_kept_rows_are_linked_into_the_view_and_read_by_the_replay(tmp_path):
    from eagle_pipeline.samples import SAMPLES_DIR

    kept_dir, view = tmp_path / "04_train" / kept.KEPT_DIR, tmp_path / "04_train" / "split_data"
    (view / SAMPLES_DIR).mkdir(parents=True)
    sample = {"hidden_states": torch.randn(3, 4, 8), "token_ids": torch.tensor([1, 2, 3])}
    write_sample(kept_dir, 7, sample, [1, 2, 3], num_states=4)
    # The view written for stage 02's states, which an online run never stored: dangling links.
    order = [2, 5, 7]
    for new_row, old_row in enumerate(order):
        os.symlink(f"../../../02/hs_{old_row}.safetensors", sample_path(view / SAMPLES_DIR, new_row))
    assert kept.link_kept_states(view, order, kept_dir) == 1
    assert sorted(p.name for p in (view / SAMPLES_DIR).iterdir()) == ["hs_2.safetensors"]
    assert (view / SAMPLES_DIR / "hs_2.safetensors").resolve() == sample_path(kept_dir, 7).resolve()
    stage02 = tmp_path / "02" / "data"
    assert kept.stored_sample_path(stage02, tmp_path / "04_train", 7) == sample_path(kept_dir, 7)
    write_sample(stage02 / SAMPLES_DIR, 7, sample, [1, 2, 3], num_states=4)
    assert kept.stored_sample_path(stage02, tmp_path / "04_train", 7) == sample_path(stage02 / SAMPLES_DIR, 7)


def test_kept_rows_are_captured_once_and_stale_ones_removed(tmp_path):
    calls = []

    class Client:
        def capture(self, ids):
            calls.append(list(ids))
            return {"hidden_states": torch.ones(len(ids), 4, 8), "token_ids": torch.tensor(ids)}, {}

    rows = {3: [1, 2, 3], 9: [4, 5]}
    kwargs = {"num_states": 4, "hidden_size": 8, "storage_dtype": kept.kept_storage("fp8")}
    assert kept.capture_kept(Client(), rows, tmp_path, **kwargs) == 2
    assert kept.capture_kept(Client(), rows, tmp_path, **kwargs) == 0 and len(calls) == 2
    assert kept.capture_kept(Client(), {9: [4, 5]}, tmp_path, **kwargs) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hs_9.safetensors"]


def test_the_replays_rows_decide_how_many_are_kept(tmp_path):
    cfg = _load(tmp_path, mode="online")
    assert kept.keep_count(cfg) == max(cfg.train.predict_conversations, cfg.convert.parity_prompts)
    cfg.convert.parity = "vllm"
    assert kept.keep_count(cfg) == cfg.train.predict_conversations


# ---------------------------------------------------------------- the window and its peak


def test_the_window_bounds_the_states_in_flight(tmp_path):
    cfg = _load(tmp_path, mode="online", online_window=3)  # tiny.yaml: float32 engine, 4 states of 576
    one = sample_bytes(cfg, 4, 576, 100)
    assert one == 100 * (4 * 576 * 4 + 8) + 4096
    assert window_bound(cfg, 4, 576, 100) == 3 * one
    fp8 = _load(tmp_path, mode="online", transfer="fp8")
    assert sample_bytes(fp8, 4, 576, 100) < one / 3
    text = "\n".join(plan_lines(cfg, 4, 576, 100))
    assert "3 sample(s) in flight per rank x 1 rank(s)" in text and "one started on this host" in text


def test_the_peak_watch_keeps_the_largest_value_it_saw():
    values = iter([1, 5, 2] + [0] * 1000)
    with PeakWatch(lambda: next(values), interval_s=0.001) as watch:
        time.sleep(0.1)
    assert watch.peak == 5 and watch.samples >= 3
    with PeakWatch(lambda: 1 / 0, interval_s=0.001) as broken:
        time.sleep(0.01)
    assert broken.peak == 0


# ---------------------------------------------------------------- a server that stays away


ONLINE = settings.OnlineTraining(endpoints=["http://a:1/v1", "http://b:2/v1"], transfer="file", window=1, retry_s=30)


def test_the_circuit_breaker_becomes_a_failure_naming_the_ranks_server(tmp_path):
    breaker = RuntimeError("Hidden-state generation circuit breaker tripped on 1 rank(s) during training. "
                           "Local error: APIConnectionError: Connection error.")
    with pytest.raises(failure.CaptureUnavailable, match=r"capture server http://b:2/v1 delivered no hidden states.*"
                                                         r"capture_retry_s 30 s\).*Connection error.*rerun stage 04"):
        with failure.online_rank(ONLINE, tmp_path, rank=1):
            raise breaker
    assert "http://b:2/v1" in failure.capture_failure(tmp_path)
    with failure.online_rank(ONLINE, tmp_path, rank=0):  # a new attempt forgets the last one's failure
        pass
    assert failure.capture_failure(tmp_path) is None
    with pytest.raises(RuntimeError, match="shape mismatch"), failure.online_rank(ONLINE, tmp_path, rank=0):
        raise RuntimeError("shape mismatch")
    with pytest.raises(RuntimeError, match="circuit breaker"), failure.online_rank(None, tmp_path, rank=0):
        raise breaker  # offline runs are left alone


def test_speculators_still_names_its_circuit_breaker_as_the_failure_expects():
    import inspect

    from speculators.train.recovery import BatchRecoveryCoordinator

    assert failure.CIRCUIT_BREAKER in inspect.getsource(BatchRecoveryCoordinator.synchronize)


@pytest.mark.parametrize("qualified_name", sorted(speculators_capture_stop.UPSTREAM_SOURCE_SHA256))
def test_the_capture_stop_patch_relies_on_the_speculators_it_was_written_for(qualified_name):
    assert source_sha256(qualified_name) == speculators_capture_stop.UPSTREAM_SOURCE_SHA256[qualified_name]


def test_the_capture_stop_patch_refuses_another_speculators(monkeypatch):
    from patches import speculators_cpu

    monkeypatch.setattr(speculators_cpu, "installed_version", lambda: "0.9.1")
    with pytest.raises(RuntimeError, match=r"targets speculators 0\.9\.0 but 0\.9\.1 is installed"):
        speculators_capture_stop.apply()


def _four_uncaptured_samples(tmp_path: Path, endpoint: str, guard=None):
    """speculators' online dataset over four short samples, none stored, each asked of `endpoint` once, and
    its own DataLoader with one spawned worker putting all four in one batch."""
    from datasets import Dataset
    from speculators.train.data import ArrowDataset
    from speculators.train.dataloader import _setup_dataloader

    rows = {"input_ids": [[1, 2, 3]] * 4, "loss_mask": [[1, 1, 1]] * 4, "seq_len": [3] * 4}
    Dataset.from_dict(rows).with_format("torch").save_to_disk(str(tmp_path / "data"))
    dataset = ArrowDataset(max_len=64, datapath=str(tmp_path / "data"), vllm_endpoint=endpoint, model="m",
                           on_missing="generate", request_timeout=5, max_retries=0, generation_validation_retries=0,
                           max_consecutive_generation_failures=1)
    if guard is not None:
        dataset.generation_recovery = guard
    return _setup_dataloader(dataset, total_seq_len=64, hidden_size=8, num_workers=1, prefetch_factor=1)


@pytest.mark.filterwarnings("ignore:.pin_memory. argument is set as true")  # speculators' loader, on the CPU
def test_a_capture_server_that_fails_stops_training_at_its_first_sample_even_in_a_spawned_loader(tmp_path, capfd):
    """Upstream leaves the failed samples out of their batch and raises only when the trainer synchronises (every
    50 steps on several ranks), each sample of the batch first waiting out its retries; patched, the first sample
    that reaches the limit raises, in the DataLoader worker, and its rank names the server."""
    from speculators.train.recovery import GenerationRecoveryGuard

    speculators_capture_stop.apply()
    endpoint = "http://127.0.0.1:9/v1"  # nothing listens there
    failed = "Hidden-state round trip failed for dataset index"
    upstream = iter(_four_uncaptured_samples(tmp_path / "upstream", endpoint, GenerationRecoveryGuard(0, 1)))
    next(upstream)  # a batch, every sample of it left out
    assert capfd.readouterr().err.count(failed) == 4
    patched = iter(_four_uncaptured_samples(tmp_path / "patched", endpoint))
    online = settings.OnlineTraining(endpoints=[endpoint], transfer="file", window=2, retry_s=1)
    with pytest.raises(failure.CaptureUnavailable, match=f"capture server {endpoint} delivered no hidden states"):
        with failure.online_rank(online, tmp_path, rank=0):
            next(patched)
    assert capfd.readouterr().err.count(failed) == 1


# ---------------------------------------------------------------- the GPU memory plan


# Kimi-K2.5's text config, as far as the plan reads it.
KIMI_TEXT = {"num_hidden_layers": 61, "hidden_size": 7168, "vocab_size": 163840, "q_lora_rank": 1536, "kv_lora_rank": 512,
             "qk_rope_head_dim": 64, "n_routed_experts": 384, "first_k_dense_replace": 1}


def kimi_plan(total_seq_len: int, utilization: float) -> memory_plan.MemoryPlan:
    """Kimi-K2.5 INT4 (~600 GB of weights, MLA) on 8 GPUs of 96 GB (97,887 MiB as nvidia-smi reports them), with
    configs/kimi-k2.5.yaml's drafter."""
    from eagle_pipeline.drafter.tensors import DraftDims

    vocab, hidden = 163840, 7168
    target = memory_plan.TargetShape(weights_bytes=600 * 10**9, layers=61, hidden_size=hidden, vocab_size=vocab,
                                     kv_bytes_per_token=(512 + 64) * 61 * 2,
                                     replicated_bytes=2 * memory_plan.replicated_params(KIMI_TEXT))
    drafter = memory_plan.DrafterShape.from_dims(DraftDims(
        format="speculators", hidden_size=hidden, num_attention_heads=64, num_key_value_heads=64, head_dim=128,
        intermediate_size=18432, vocab_size=vocab, draft_vocab_size=32000, num_aux=3, target_hidden_size=hidden,
        num_layers=1, attention_bias=False, mlp_bias=False, norm_before_fc=False, fc_norm=False))
    return memory_plan.plan_memory(gpu_bytes=97887 * 2**20, gpus=8, utilization=utilization, target=target,
                                   drafter=drafter, num_states=4, longest_sequence=total_seq_len,
                                   total_seq_len=total_seq_len, ttt_steps=3, window=1)


def test_kimi_on_one_host_fits_co_located_with_packs_of_1024_not_2048():
    # What every GPU holds whole: per layer q_a_proj (1536 x 7168), kv_a_proj_with_mqa (576 x 7168), their norms
    # and the two layer norms; the router (384 x 7168, and its bias) of the 60 MoE layers; the final norm.
    assert memory_plan.replicated_params(KIMI_TEXT) == (61 * (2112 * 7168 + 1536 + 512 + 2 * 7168)
                                                        + 60 * 384 * 7169 + 7168)
    fits = kimi_plan(1024, 0.80)
    assert fits.fits and 1 <= fits.sequences_in_cache < fits.concurrent_requests == 8
    assert 71 < fits.vllm["weights"] / memory_plan.GIB < 72  # not the 69.8 of the files split eight ways
    assert fits.vllm["CUDA graphs"] == 0  # capture servers run eager
    assert fits.trainer["gathered root (bf16)"] == 2 * (163840 + 2 * 32000 + 3 * 7168) * 7168
    assert fits.margin_bytes >= memory_plan.MARGIN_FRACTION * fits.gpu_bytes
    assert "co-located: fits" in fits.lines()[0] and "to fit" not in "\n".join(fits.lines())
    # Packs of 2048 leave less than the margin beside a share that holds one sequence: no share fits.
    too_long = kimi_plan(2048, 0.80)
    assert not too_long.fits and too_long.fitting_utilization() is None
    assert 1 < too_long.margin_bytes / memory_plan.GIB < 4
    assert "lower train.total_seq_len" in too_long.lines()[-1]
    greedy = kimi_plan(1024, 0.85)  # vLLM takes the whole share: too little left for the trainer
    assert not greedy.fits and greedy.fitting_utilization() == 0.80
    assert "set hidden_states.capture_gpu_memory_utilization 0.80" in greedy.lines()[-1]


def test_the_single_host_kimi_config_is_the_plan_that_fits():
    cfg = load_config(str(Path(__file__).resolve().parent.parent / "configs" / "kimi-k2.5-10k-online.yaml"))
    plan = kimi_plan(cfg.train.total_seq_len, cfg.hidden_states.capture_gpu_memory_utilization)
    assert cfg.hidden_states.max_seq_len == cfg.train.total_seq_len and cfg.hidden_states.online_window == 1
    assert plan.fits, plan.lines()



def test_beside_the_trainer_the_capture_server_takes_the_sequences_its_cache_holds(tmp_path, monkeypatch):
    """Kimi on one host leaves the capture server KV for 2 of the 8 longest sequences the ranks ask for: the plan
    says so and the server is sized to it; without a plan (no GPU to read, or another host) it takes the ranks'."""
    from types import SimpleNamespace

    from eagle_pipeline.online.servers import server_kwargs_for

    plan = kimi_plan(1024, 0.80)
    assert plan.server_sequences == plan.sequences_in_cache == 2 < plan.concurrent_requests
    assert "the cache holds 2 of the 8 longest sequences" in plan.lines()[1]
    assert "the server takes 2 at once (--max-num-seqs)" in plan.lines()[1]
    cfg = _load(tmp_path, mode="online", online_window=3)
    verifier = SimpleNamespace(path=str(tmp_path), fingerprints=lambda: {"verifier": "v"})
    layout = SimpleNamespace(layer_ids=[1, 2], num_layers=4, hidden_size=8)

    def max_num_seqs(planned) -> str:
        monkeypatch.setattr(servers, "run_plan", lambda *args, **kwargs: planned)
        flags = server_kwargs_for(cfg, verifier, layout, storage=tmp_path, mooncake_client=None,
                                  longest_sequence=64)["extra_args"]
        return flags[flags.index("--max-num-seqs") + 1]

    assert max_num_seqs(plan) == "2"
    assert max_num_seqs(None) == max_num_seqs("  memory plan: no nvidia-smi here") == "3"

def test_the_targets_kv_per_token_is_read_from_its_config(tmp_path):
    (tmp_path / "a.safetensors").write_bytes(b"x" * 10)
    mla = memory_plan.target_shape(tmp_path, {"num_hidden_layers": 61, "hidden_size": 7168, "vocab_size": 8,
                                              "kv_lora_rank": 512, "qk_rope_head_dim": 64}, tensor_parallel=8)
    assert mla.kv_bytes_per_token == 576 * 61 * 2 and mla.weights_bytes == 10
    gqa = memory_plan.target_shape(tmp_path, {"num_hidden_layers": 30, "hidden_size": 576, "vocab_size": 8,
                                              "num_attention_heads": 9, "num_key_value_heads": 3}, tensor_parallel=1)
    assert gqa.kv_bytes_per_token == 2 * 3 * 64 * 30 * 2


# ---------------------------------------------------------------- the CPU connectors' patch


def test_cpu_connector_patch_matches_installed_upstream():
    """Fails when hs_connectors' code that the CPU connectors rely on changes: re-check patches/cpu_hs_connectors.py."""
    from patches import cpu_hs_connectors as patch
    from patches.upstream import changed_sources

    assert changed_sources(patch.UPSTREAM_SOURCE_SHA256) == []
    assert patch.CpuFp8HiddenStatesConnector._write_tensors is patch.FP8HiddenStatesConnector._write_tensors
    assert patch.CpuFp8HiddenStatesConnector._submit_async_write is patch.CpuHiddenStatesConnector._submit_async_write
    streams = patch.CpuMooncakeHiddenStatesConnector._device(None)
    stream, event = streams.Stream(), streams.Event()
    event.record()
    stream.wait_event(event)
    with streams.stream(stream):
        pass


def test_cpu_connector_patch_refuses_other_releases(monkeypatch):
    import hs_connectors

    from patches import cpu_hs_connectors as patch

    monkeypatch.setattr(hs_connectors, "__version__", "0.10.0")
    with pytest.raises(RuntimeError, match=r"patches/cpu_hs_connectors\.py targets hs_connectors 0\.9\.0 but 0\.10\.0 is installed"):
        importlib.reload(patch)
    monkeypatch.undo()
    importlib.reload(patch)


def test_mooncake_clients_hold_no_store_memory_of_their_own(tmp_path):
    from eagle_pipeline.online import mooncake

    cfg = _load(tmp_path, mode="online", transfer="mooncake")
    client = mooncake.client_config(cfg.hidden_states.mooncake, "127.0.0.1:50051")
    assert client["global_segment_size"] == 0 and client["local_hostname"] == "127.0.0.1"
    assert client["metadata_server"] == "P2PHANDSHAKE" and client["master_server_address"] == "127.0.0.1:50051"
    from hs_connectors.mooncake_store import MooncakeStoreConfig

    assert set(client) == set(MooncakeStoreConfig.__dataclass_fields__)  # every field hs_connectors reads, no other
    remote = mooncake.client_config(cfg.hidden_states.mooncake.model_copy(update={"local_hostname": "10.0.0.2"}), "10.0.0.5:1")
    assert remote["local_hostname"] == "10.0.0.2"


@pytest.mark.parametrize("package, missing", [(True, "its mooncake_master program is not installed"),
                                              (False, "the mooncake package is not installed")])
def test_a_missing_mooncake_is_named_with_its_install(monkeypatch, package, missing):
    """Whether or not this machine has requirements/online.txt installed."""
    import importlib.util

    from eagle_pipeline.online import mooncake

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: (object() if package else None) if name == "mooncake" else find_spec(name, *args))
    monkeypatch.setattr(mooncake, "program_path", lambda name: None)
    with pytest.raises(BadInput, match=rf"hidden_states\.transfer: mooncake, but {missing}.*requirements/online\.txt.*libibverbs1"):
        mooncake.require_mooncake()


# ---------------------------------------------------------------- remote.sh capture


def test_remote_capture_starts_the_capture_server_detached_and_capture_stop_finds_it_gone(tmp_path):
    """`remote.sh capture` runs eagle_pipeline.online.serve_capture detached on the host, logging there; this
    one's config is offline, so the server refuses at once, in one line, and capture-stop finds nothing running."""
    import subprocess

    from conftest import REPO

    env = {**os.environ, "EAGLE_HOST": "local", "EAGLE_REMOTE_DIR": str(tmp_path / "host"), "HF_HUB_OFFLINE": "1"}

    def remote(*args):
        return subprocess.run([str(REPO / "scripts" / "remote.sh"), *args], env=env, capture_output=True, text=True,
                              timeout=300)

    assert remote("sync").returncode == 0
    os.symlink(REPO / ".venv", tmp_path / "host" / ".venv")
    config = write_config(tmp_path / "host" / "configs" / "offline.yaml", data_root=str(tmp_path / "d"), run_name="t")
    started = remote("capture", "configs/offline.yaml", "--port", "18999")
    assert started.returncode == 0, started.stderr
    assert "capture server of configs/offline.yaml starting on local" in started.stdout
    log = tmp_path / "host" / "logs" / "capture-offline.log"
    deadline = time.monotonic() + 120
    while "error:" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline, "the capture server never answered"
        time.sleep(0.5)
    assert log.read_text().strip().splitlines()[-1] == (
        "error: hidden_states.mode: a capture server serves online runs; set mode: online in the config")
    assert config.is_file()
    pid = int((tmp_path / "host" / "logs" / "capture-offline.pid").read_text())
    while Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1][:3]:
        assert time.monotonic() < deadline, "the refused capture server did not exit"
        time.sleep(0.2)
    stopped = remote("capture-stop", "configs/offline.yaml")
    assert stopped.returncode == 2 and "error: no capture server of configs/offline.yaml runs on local" in stopped.stderr


def test_the_capture_host_starts_the_mooncake_master_its_config_names_on_it():
    from eagle_pipeline.online.mooncake import names_this_host

    assert names_this_host("127.0.0.1:50051") and names_this_host("localhost:50051")
    assert not names_this_host("192.0.2.1:50051")  # TEST-NET-1: never this machine
    assert not names_this_host("no-such-host.invalid:50051")


def test_the_replays_read_an_online_runs_kept_rows(tmp_path):
    """The checkpoint replay and stage 05's parity replay (validation_conversations) find the states stage 04
    kept when stage 02 stored none."""
    from datasets import Dataset

    from eagle_pipeline.samples import BadSample
    from eagle_pipeline.train.predicted_acceptance import validation_conversations

    data_dir, out_dir = tmp_path / "02_extract_hidden" / "data", tmp_path / "04_train"
    Dataset.from_list([{"input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1], "seq_len": 4}] * 3).save_to_disk(str(data_dir))
    out_dir.mkdir()
    (out_dir / "split.json").write_text(json.dumps({"val_rows": [2, 0]}))
    states = torch.randn(4, 4, 8)
    write_sample(out_dir / kept.KEPT_DIR, 2, {"hidden_states": states, "token_ids": torch.tensor([1, 2, 3, 4])},
                 [1, 2, 3, 4], num_states=4)
    [(token_ids, hidden, prompt_len)] = validation_conversations(data_dir, out_dir, 1)
    assert token_ids.tolist() == [1, 2, 3, 4] and prompt_len == 2
    assert torch.equal(hidden, states.bfloat16().float())
    with pytest.raises(BadSample, match=r"kept_states/hs_0\.safetensors: missing"):
        validation_conversations(data_dir, out_dir, 2)  # row 0 was not kept


# ---------------------------------------------------------------- bench/online.py's document


def test_the_benchmark_document_is_headed_by_its_command_and_judges_each_arm():
    import argparse

    from bench.online import render

    args = argparse.Namespace(work_dir="runs/online-bench", config="configs/tiny.yaml", samples=100, epochs=2,
                              engine_dtype="bfloat16")
    stage02 = {"wall_s": 50.0, "tokens": 30000, "stored_bytes": 10**8, "capture_tokens_per_s": 900.0}
    online = {"transfer": "file", "capture_tokens": 60000, "capture_tokens_per_s": 1100.0, "window_bound_bytes": 1.4e6,
              "disk_peak_bytes": 1.3e6, "kept_bytes": 1.5e7}
    figures = {
        "offline": {"stage02": stage02, "stage04": {"wall_s": 160.0, "train_tokens_per_s": 250.0, "final_val": {"loss": 11.0},
                                                    "online": None}},
        "online_file": {"stage02": {**stage02, "wall_s": 5.0, "stored_bytes": 0},
                        "stage04": {"wall_s": 220.0, "train_tokens_per_s": 214.0, "final_val": {"loss": 11.0}, "online": online}},
        "online_mooncake": {"error": "the mooncake package is not installed"},
    }
    same = {"conversations": 15, "offline_mean": 1.23, "arms": {
        "online_file": {"mean": 1.23, "mean_difference": 0.0, "ci95_half_width": 0.0, "weight_relative_difference": 0.0},
        "online_fp8": {"mean": 1.2, "mean_difference": -0.03, "ci95_half_width": 0.01, "weight_relative_difference": 0.03}}}
    env = {"cpu": "a CPU", "cores": 2, "load_start": 0.5, "load_end": 1.5}
    text = render(".venv/bin/python -m bench.online --config configs/tiny.yaml", args, figures, same, env, 17.0)
    assert text.startswith("# Online against offline training")
    assert "```bash\n.venv/bin/python -m bench.online --config configs/tiny.yaml\n```" in text
    assert "| offline | 50 | 160 | 210 | 250 | 900 (stage 02's engine) | 0.10 GB (every sample, on disk) |" in text
    assert "1.3 MB peak on disk (bound 1.4 MB) + 15.0 MB kept" in text
    assert "| online_mooncake | n/a (the mooncake package is not installed) |" in text
    assert "| online_file | +0.000 | ±0.000 | yes | 0.00% |" in text
    assert "| online_fp8 | -0.030 | ±0.010 | no | 3.00% |" in text  # a difference beyond the interval is named


def test_an_online_run_starts_the_target_in_stage_04_not_stage_02():
    from conftest import REPO

    from eagle_pipeline.plan.engines import target_starts

    single = target_starts(load_config(REPO / "configs" / "kimi-k2.5-10k-online.yaml"))
    assert single["02_extract_hidden"] == 0 and single["04_train"] == 1  # its own capture server
    two_hosts = target_starts(load_config(REPO / "configs" / "kimi-k2.5-100k-online-two-hosts.yaml"))
    assert two_hosts["02_extract_hidden"] == 0 and two_hosts["04_train"] == 0  # host A's server, started apart
    offline = target_starts(load_config(REPO / "configs" / "kimi-k2.5-10k.yaml"))
    assert offline["02_extract_hidden"] == 1 and offline["04_train"] == 0


def test_mooncake_services_start_until_the_store_joins_and_stop_whole(tmp_path):
    """The master and store of stage 04 (or a capture host) for real: the store's capacity is in the master's
    metrics once started, and nothing of either process group is left after the block."""
    from eagle_pipeline.config.data import MooncakeSettings
    from eagle_pipeline.online import mooncake as mc
    from eagle_pipeline.process_tree import live_group_members

    if mc.mooncake_problem():
        pytest.skip(mc.mooncake_problem())
    with mc.MooncakeServices(MooncakeSettings(store_gib=0.25), tmp_path / "logs") as services:
        groups = [child.pid for child in services.children]
        assert mc.read_metrics(services.metrics_url)["master_total_capacity_bytes"] == 2**28
        assert services.allocated_bytes() == 0 and all(live_group_members(group) for group in groups)
    assert len(groups) == 2 and not any(live_group_members(group) for group in groups)
    assert services.children == []
    assert (tmp_path / "logs" / "mooncake-master.log").read_text().startswith("$ ")
