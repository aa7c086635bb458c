"""Tests of stage 06's measuring core: metric parsing and summary on real /metrics text, the server's
lifecycle (busy port, early death, Ctrl-C, no orphans), and real vLLM serving runs."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from eagle_pipeline.child_process import ChildProcess, Guard
from eagle_pipeline.errors import BadInput
from eagle_pipeline.serve.client import PromptRun, RequestResult, run_prompts
from eagle_pipeline.serve.measure import ModeMeasurement, mode_record, speculative_config_for, summarize_records
from eagle_pipeline.serve.report import write_report
from eagle_pipeline.serve.server import ServerFailed, VllmServer, check_port_free, find_free_port
from eagle_pipeline.serve.spec_metrics import (
    acceptance_stats,
    metrics_delta,
    parse_spec_metrics,
    request_acceptance,
    scrape_spec_metrics,
)

# Excerpts of /metrics captured from a real vLLM 0.32 CPU server (SmolLM2-135M-Instruct, ngram, 3 draft
# tokens), before and after a prompt run; only the model_name label was shortened. AFTER keeps the
# HELP/TYPE lines, `_created` gauges and histogram buckets that the parser must skip; BEFORE is the bare
# sample lines, as a scrape without metadata would give them.
METRICS_AFTER = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="/models/smollm2-135m-instruct"} 212.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="/models/smollm2-135m-instruct"} 1.795950067497156e+09
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="/models/smollm2-135m-instruct"} 636.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="/models/smollm2-135m-instruct"} 137.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/models/smollm2-135m-instruct",position="0"} 73.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/models/smollm2-135m-instruct",position="1"} 34.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/models/smollm2-135m-instruct",position="2"} 30.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_created Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_created gauge
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="/models/smollm2-135m-instruct",position="0"} 1.7959500674972334e+09
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="/models/smollm2-135m-instruct",position="1"} 1.79595006749724e+09
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="/models/smollm2-135m-instruct",position="2"} 1.7959500674972458e+09
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="/models/smollm2-135m-instruct"} 544.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="/models/smollm2-135m-instruct"} 9.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="/models/smollm2-135m-instruct"} 9.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="/models/smollm2-135m-instruct"} 2.456728458404541
# HELP vllm:request_time_per_output_token_seconds Histogram of time_per_output_token_seconds per request.
# TYPE vllm:request_time_per_output_token_seconds histogram
vllm:request_time_per_output_token_seconds_bucket{engine="0",le="0.05",model_name="/models/smollm2-135m-instruct"} 9.0
vllm:request_time_per_output_token_seconds_bucket{engine="0",le="+Inf",model_name="/models/smollm2-135m-instruct"} 9.0
vllm:request_time_per_output_token_seconds_count{engine="0",model_name="/models/smollm2-135m-instruct"} 9.0
vllm:request_time_per_output_token_seconds_sum{engine="0",model_name="/models/smollm2-135m-instruct"} 0.2623481791778855
# HELP vllm:request_time_per_output_token_seconds_created Histogram of time_per_output_token_seconds per request.
# TYPE vllm:request_time_per_output_token_seconds_created gauge
vllm:request_time_per_output_token_seconds_created{engine="0",model_name="/models/smollm2-135m-instruct"} 1.7959500674983892e+09
"""

METRICS_BEFORE = """\
vllm:spec_decode_num_drafts_total{engine="0",model_name="/models/smollm2-135m-instruct"} 1.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="/models/smollm2-135m-instruct"} 3.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="/models/smollm2-135m-instruct"} 3.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/models/smollm2-135m-instruct",position="0"} 1.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/models/smollm2-135m-instruct",position="1"} 1.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/models/smollm2-135m-instruct",position="2"} 1.0
vllm:generation_tokens_total{engine="0",model_name="/models/smollm2-135m-instruct"} 8.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="/models/smollm2-135m-instruct"} 1.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="/models/smollm2-135m-instruct"} 1.2155818939208984
vllm:request_time_per_output_token_seconds_count{engine="0",model_name="/models/smollm2-135m-instruct"} 1.0
vllm:request_time_per_output_token_seconds_sum{engine="0",model_name="/models/smollm2-135m-instruct"} 0.021073786714233784
"""

# Same server family without speculation: vLLM exports no spec_decode_* series at all.
METRICS_NO_SPECULATION = """\
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="/models/smollm2-135m-instruct"} 544.0
vllm:request_time_per_output_token_seconds_count{engine="0",model_name="/models/smollm2-135m-instruct"} 9.0
vllm:request_time_per_output_token_seconds_sum{engine="0",model_name="/models/smollm2-135m-instruct"} 0.411377966913159
"""

# Delta of the two real scrapes, worked out by hand.
DRAFTS, DRAFT_TOKENS, ACCEPTED, PER_POS = 211, 633, 134, [72, 33, 29]


# ----------------------------------------------------------------------------------------------------
# Metric parsing and summary


def test_parse_reads_spec_counters_and_skips_created_gauges_and_buckets():
    m = parse_spec_metrics(METRICS_AFTER)
    assert m["num_drafts"] == 212
    assert m["num_draft_tokens"] == 636
    assert m["num_accepted_tokens"] == 137
    assert m["accepted_per_pos"] == [73, 34, 30]
    assert m["generation_tokens"] == 544
    assert m["tpot_count"] == 9 and m["tpot_sum_s"] == pytest.approx(0.2623481791778855)
    assert m["ttft_count"] == 9 and m["ttft_sum_s"] == pytest.approx(2.456728458404541)


def test_parse_without_speculation_gives_zero_counters_and_no_positions():
    m = parse_spec_metrics(METRICS_NO_SPECULATION)
    assert (m["num_drafts"], m["num_draft_tokens"], m["num_accepted_tokens"]) == (0, 0, 0)
    assert m["accepted_per_pos"] == []
    assert m["generation_tokens"] == 544
    assert acceptance_stats(m)["mean_acceptance_length"] is None


def test_parse_sums_engines_of_a_data_parallel_server():
    second_engine = "\n".join(
        line.replace('engine="0"', 'engine="1"') for line in METRICS_BEFORE.splitlines()
    )
    m = parse_spec_metrics(METRICS_AFTER + second_engine + "\n")
    assert m["num_drafts"] == 212 + 1
    assert m["accepted_per_pos"] == [74, 35, 31]


def test_delta_subtracts_the_warm_up_scrape():
    delta = metrics_delta(parse_spec_metrics(METRICS_BEFORE), parse_spec_metrics(METRICS_AFTER))
    assert (delta["num_drafts"], delta["num_draft_tokens"], delta["num_accepted_tokens"]) == (DRAFTS, DRAFT_TOKENS, ACCEPTED)
    assert delta["accepted_per_pos"] == PER_POS
    assert delta["generation_tokens"] == 536
    stats = acceptance_stats(delta)
    assert stats["acceptance_rate"] == pytest.approx(ACCEPTED / DRAFT_TOKENS)
    assert stats["mean_acceptance_length"] == pytest.approx(1 + ACCEPTED / DRAFTS)
    assert stats["per_position_acceptance"] == pytest.approx([a / DRAFTS for a in PER_POS])


def _run(texts, tokens, wall_s):
    return PromptRun(
        requests=[RequestResult(text=t, output_tokens=n, prompt_tokens=5, latency_s=wall_s / len(texts),
                                finish_reason="length") for t, n in zip(texts, tokens)],
        wall_s=wall_s,
    )


def _measurements():
    spec_delta = metrics_delta(parse_spec_metrics(METRICS_BEFORE), parse_spec_metrics(METRICS_AFTER))
    plain_delta = parse_spec_metrics(METRICS_NO_SPECULATION)
    ngram_config = speculative_config_for("ngram", num_speculative_tokens=3)
    eagle_config = {"method": "eagle3", "model": "/drafter", "num_speculative_tokens": 3}
    return {
        "none": ModeMeasurement("none", None, _run(["a", "b", "c"], [10, 20, 30], 2.0), plain_delta, 60.0),
        "ngram": ModeMeasurement("ngram", ngram_config, _run(["a", "B", "c"], [10, 20, 30], 1.0), spec_delta, 61.0),
        "eagle3": ModeMeasurement("eagle3", eagle_config, _run(["a", "b", "c"], [10, 20, 30], 1.5), spec_delta, 62.0),
    }


def summarize(measurements, **settings) -> dict:
    return summarize_records({name: mode_record(m) for name, m in measurements.items()}, **settings)


def test_summarize_gives_the_report_fields():
    report = summarize(_measurements(), num_speculative_tokens=3, temperature=0.0, max_tokens=30, concurrency=1)
    assert report["num_prompts"] == 3
    assert report["num_speculative_tokens"] == 3
    assert report["tokens_per_s"] == pytest.approx({"none": 30.0, "ngram": 60.0, "eagle3": 40.0})
    assert report["speedup"] == pytest.approx(40.0 / 30.0)
    assert report["speedup_by_mode"]["ngram"] == pytest.approx(2.0)
    assert report["acceptance_rate"] == pytest.approx(ACCEPTED / DRAFT_TOKENS)
    assert report["mean_acceptance_length"] == pytest.approx(1 + ACCEPTED / DRAFTS)
    assert report["per_position_acceptance"] == pytest.approx([a / DRAFTS for a in PER_POS])
    # The headline flag speaks for the drafter; ngram's differing prompt is listed, not hidden.
    assert report["greedy_match"] is True
    assert report["greedy_mismatches"] == {"ngram": [1], "eagle3": []}
    assert report["ngram_acceptance"]["mean_acceptance_length"] == pytest.approx(1 + ACCEPTED / DRAFTS)
    # Server-side mean time per output token over the 8 requests of the run.
    assert report["tpot_ms"]["ngram"] == pytest.approx((0.2623481791778855 - 0.021073786714233784) / 8 * 1000)
    assert report["tpot_ms"]["none"] == pytest.approx(0.411377966913159 / 9 * 1000)
    assert "acceptance_rate" not in report["modes"]["none"]


def test_greedy_mismatch_of_the_drafter_fails_the_flag():
    measurements = _measurements()
    measurements["eagle3"].run.requests[2].text = "different"
    report = summarize(measurements, num_speculative_tokens=3, temperature=0.0)
    assert report["greedy_match"] is False
    assert report["greedy_mismatches"]["eagle3"] == [2]


def test_greedy_check_is_not_claimed_when_sampling():
    report = summarize(_measurements(), num_speculative_tokens=3, temperature=0.7)
    assert report["greedy_match"] is None
    assert report["greedy_mismatches"] == {}


def test_modes_that_ran_different_prompt_counts_are_refused():
    measurements = _measurements()
    measurements["ngram"].run.requests.pop()
    with pytest.raises(ValueError, match="different numbers of prompts"):
        summarize(measurements, num_speculative_tokens=3, temperature=0.0)


def test_write_report_writes_json_markdown_png_and_responses(tmp_path):
    import matplotlib.image

    report = summarize(_measurements(), num_speculative_tokens=3, temperature=0.0, max_tokens=30, concurrency=1)
    report["texts"] = {mode: m.run.texts for mode, m in _measurements().items()}
    prompts = [[{"role": "user", "content": f"prompt {i}"}] for i in range(3)]
    paths = write_report(tmp_path, report, prompts)

    written = json.loads(paths["report.json"].read_text())
    for key in ("num_prompts", "num_speculative_tokens", "mean_acceptance_length", "acceptance_rate",
                "per_position_acceptance", "tokens_per_s", "speedup", "greedy_match"):
        assert key in written, key
    assert set(written["tokens_per_s"]) == {"eagle3", "none", "ngram"}
    assert "texts" not in written

    markdown = paths["report.md"].read_text()
    assert "| eagle3 | 60 |" in markdown and "| ngram |" in markdown and "| none |" in markdown
    assert "ngram: 1 prompt(s) differ: [1]" in markdown and "float32 checks exactness" in markdown

    image = matplotlib.image.imread(paths["report.png"])
    assert image.shape[:2] == (400, 1000)

    rows = [json.loads(line) for line in paths["responses.jsonl"].read_text().splitlines()]
    assert rows[1]["responses"] == {"none": "b", "ngram": "B", "eagle3": "b"}
    assert not list(tmp_path.glob(".tmp-*"))


# ----------------------------------------------------------------------------------------------------
# Client side, against a stand-in HTTP endpoint


class _FakeOpenAIServer:
    """Answers /v1/chat/completions by echoing the prompt upper-cased (status per prompt text), and /metrics."""

    def __init__(self, statuses: dict[str, int] | None = None, delay_s: float = 0.0):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        fake = self
        self.statuses = statuses or {}
        self.received: list[str] = []

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status: int, body: bytes, content_type: str = "application/json"):
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                self._send(200, METRICS_AFTER.encode(), "text/plain")

            def do_POST(self):
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                prompt = request["messages"][0]["content"]
                fake.received.append(prompt)
                time.sleep(delay_s)
                status = fake.statuses.get(prompt, 200)
                if status != 200:
                    body = {"error": {"message": f"cannot serve {prompt!r}", "type": "BadRequestError", "code": status}}
                    return self._send(status, json.dumps(body).encode())
                words = len(prompt.split())
                self._send(200, json.dumps({
                    "id": "x", "object": "chat.completion", "created": 0, "model": request["model"],
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": prompt.upper()}}],
                    "usage": {"prompt_tokens": words, "completion_tokens": 2 * words, "total_tokens": 3 * words},
                    # vLLM's per-request acceptance (--per-request-spec-decode-metrics summary): one step that
                    # accepted nothing and one per word that accepted all 3 drafts.
                    "metrics": {"speculative_decoding": {
                        "mean_acceptance_length": 1 + 3 * words / (words + 1), "draft_acceptance_rate": words / (words + 1),
                        "acceptance_histogram": [1, 0, 0, words], "num_spec_steps": words + 1,
                        "num_accepted_draft_tokens": 3 * words, "num_draft_tokens": 3 * (words + 1), "num_spec_tokens": 3}},
                }).encode())

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _chat(*texts):
    return [[{"role": "user", "content": t}] for t in texts]


def test_run_prompts_keeps_prompt_order_and_records_usage():
    fake = _FakeOpenAIServer(delay_s=0.05)
    try:
        run = run_prompts(fake.base_url, "m", _chat("one", "two words", "three more words", "four"),
                          max_tokens=8, concurrency=3)
    finally:
        fake.close()
    assert run.texts == ["ONE", "TWO WORDS", "THREE MORE WORDS", "FOUR"]
    assert [r.output_tokens for r in run.requests] == [2, 4, 6, 2] and run.output_tokens == 14
    assert all(r.latency_s >= 0.05 for r in run.requests) and run.wall_s >= 0.05
    # Each request's own acceptance, from the response's metrics.speculative_decoding.
    per_request = [request_acceptance(r.spec_decode) for r in run.requests]
    assert [a["num_drafts"] for a in per_request] == [2, 3, 4, 2]
    assert per_request[1]["mean_acceptance_length"] == pytest.approx(1 + 6 / 3)
    assert per_request[2]["per_position_acceptance"] == pytest.approx([3 / 4, 3 / 4, 3 / 4])


def test_rejected_prompt_is_bad_input_naming_its_index():
    fake = _FakeOpenAIServer(statuses={"too long": 400})
    try:
        with pytest.raises(BadInput, match=r"^prompt 1: the server rejected it .*cannot serve 'too long'"):
            run_prompts(fake.base_url, "m", _chat("fine", "too long"), max_tokens=8)
    finally:
        fake.close()


def test_a_failed_request_stops_the_remaining_prompts():
    import openai

    fake = _FakeOpenAIServer(statuses={"boom": 500})
    try:
        with pytest.raises(openai.InternalServerError):
            run_prompts(fake.base_url, "m", _chat("boom", "b", "c", "d", "e"), max_tokens=8, concurrency=1)
        time.sleep(0.3)
    finally:
        fake.close()
    assert fake.received == ["boom"]


def test_scrape_reads_metrics_over_http():
    fake = _FakeOpenAIServer()
    try:
        assert scrape_spec_metrics(fake.base_url) == parse_spec_metrics(METRICS_AFTER)
    finally:
        fake.close()


# ----------------------------------------------------------------------------------------------------
# Configuration and command line


def test_speculative_configs(tmp_path):
    assert speculative_config_for("none", num_speculative_tokens=3) is None
    assert speculative_config_for("ngram", num_speculative_tokens=4, prompt_lookup_max=5, prompt_lookup_min=1) == {
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5, "prompt_lookup_min": 1}
    (tmp_path / "config.json").write_text("{}")
    assert speculative_config_for("eagle3", num_speculative_tokens=3, drafter_dir=tmp_path) == {
        "method": "eagle3", "model": str(tmp_path), "num_speculative_tokens": 3}
    with pytest.raises(BadInput, match="config.json"):
        speculative_config_for("eagle3", num_speculative_tokens=3, drafter_dir=tmp_path / "missing")
    with pytest.raises(BadInput, match="drafter"):
        speculative_config_for("eagle3", num_speculative_tokens=3)
    with pytest.raises(BadInput, match="unknown mode"):
        speculative_config_for("medusa", num_speculative_tokens=3)


def test_generation_dtype_changes_only_the_answering_engine():
    from conftest import SMOKE_CONFIG

    from eagle_pipeline.config import load_config
    from eagle_pipeline.engine import llm_kwargs, server_kwargs

    cfg = load_config(SMOKE_CONFIG, ["generation.dtype=bfloat16"])
    assert cfg.verifier.dtype == "float32"
    assert llm_kwargs(cfg, "m", dtype=cfg.generation.dtype)["dtype"] == "bfloat16"
    # Capture (stage 02), parity (05) and serving (06) keep the verifier's dtype.
    assert llm_kwargs(cfg, "m")["dtype"] == "float32"
    assert server_kwargs(cfg)["dtype"] == "float32"


def test_server_command_carries_the_speculative_config(tmp_path):
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    server = VllmServer("/models/target", speculative_config=config, max_model_len=512, dtype="bfloat16",
                        extra_args=["--enforce-eager"], log_path=tmp_path / "log")
    server.port = 12345
    cmd = server.command()
    assert cmd[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert json.loads(cmd[cmd.index("--speculative-config") + 1]) == config
    assert cmd[cmd.index("--port") + 1] == "12345" and cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[-1] == "--enforce-eager"
    plain = VllmServer("/models/target", log_path=tmp_path / "log")
    plain.port = 1
    assert "--speculative-config" not in plain.command()


def test_busy_port_is_bad_input_naming_the_port_and_field(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        server = VllmServer("/models/target", port=port, log_path=tmp_path / "server.log")
        with pytest.raises(BadInput) as excinfo:
            with server:
                pytest.fail("the server must not start on a busy port")
    message = str(excinfo.value)
    assert str(port) in message and "serve.port" in message and "\n" not in message
    assert server.process is None and not (tmp_path / "server.log").exists()


def test_free_port_passes_the_check():
    port = find_free_port()
    check_port_free(port)


def _group_members(group: int) -> list[int]:
    """Live (not zombie) processes of a process group."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == group and fields[0] != "Z":
                members.append(int(entry.name))
    return members


# A process group like a vLLM server's during its start: a leader that ignores SIGTERM, and a child.
STUBBORN_SERVER = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                   "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)")


def _wait_for_its_child(leader: int) -> None:
    deadline = time.monotonic() + 30
    while len(_group_members(leader)) < 2:
        assert time.monotonic() < deadline, "the stand-in server did not start its child"
        time.sleep(0.05)


def _stubborn_server() -> subprocess.Popen:
    server = subprocess.Popen([sys.executable, "-c", STUBBORN_SERVER], start_new_session=True)
    _wait_for_its_child(server.pid)
    return server


@pytest.mark.parametrize("healthy", [False, True], ids=["during-start", "serving"])
def test_guard_stops_the_server_group_when_its_owner_dies_without_stopping_it(tmp_path, healthy):
    server = _stubborn_server()
    grace_s = 4.0
    try:
        guard = Guard(server.pid, grace_s, tmp_path / "server.log")
        if healthy:
            guard.ready()
        died = time.monotonic()
        os.close(guard._write_end)  # what the kernel does when this process is killed
        assert guard.process.wait(timeout=30) == 0
        assert server.wait(timeout=10) == -signal.SIGKILL
        waited = time.monotonic() - died
        if healthy:
            # Asked to stop first (SIGTERM, ignored here), killed after the grace period.
            assert waited >= grace_s
        else:
            # Never healthy: nothing served to drain, and vLLM ignores SIGTERM while its engine starts.
            assert waited < grace_s
        deadline = time.monotonic() + 10
        while _group_members(server.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _group_members(server.pid) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def test_stop_kills_a_server_that_never_became_healthy_without_a_grace_period(tmp_path):
    server = VllmServer("/models/target", log_path=tmp_path / "server.log", stop_grace_s=60.0)
    server.child = ChildProcess([sys.executable, "-c", STUBBORN_SERVER], server.log_path, name="vLLM server",
                                stop_grace_s=server.stop_grace_s)
    server.child.start()
    group = server.process.pid
    try:
        _wait_for_its_child(group)
        started = time.monotonic()
        server.stop()
        assert time.monotonic() - started < 15
        assert server.process is None and _group_members(group) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)


def test_released_guard_leaves_the_server_alone(tmp_path):
    server = _stubborn_server()
    try:
        guard = Guard(server.pid, 1.0, tmp_path / "server.log")
        guard.release()
        assert guard.process.returncode == 0
        time.sleep(0.5)
        assert server.poll() is None and len(_group_members(server.pid)) == 2
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


# ----------------------------------------------------------------------------------------------------
# Real vLLM servers


def _marked_processes(marker: str) -> list[int]:
    """Pids of live processes whose environment carries our marker: the server and everything it spawned,
    wherever they were reparented to."""
    needle = f"EAGLE_TEST_SERVER_MARKER={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _server_env(marker: str) -> dict[str, str]:
    return {"VLLM_CPU_KVCACHE_SPACE": "1", "EAGLE_TEST_SERVER_MARKER": marker}


def _wait_until_gone(marker: str, timeout_s: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := _marked_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


@pytest.fixture(scope="module")
def target_dir():
    from eagle_pipeline.embedded import materialize

    return materialize("smollm2-135m-instruct")


@pytest.mark.vllm
def test_server_that_dies_during_start_fails_fast_with_its_log(tmp_path, target_dir):
    marker = uuid.uuid4().hex
    server = VllmServer(target_dir, extra_args=["--no-such-flag"], log_path=tmp_path / "server.log",
                        env=_server_env(marker), startup_timeout_s=300)
    started = time.monotonic()
    with pytest.raises(ServerFailed) as excinfo:
        with server:
            pytest.fail("a server with a bad flag must not become healthy")
    assert time.monotonic() - started < 120
    assert "exited with code" in str(excinfo.value) and "--no-such-flag" in str(excinfo.value)
    assert _wait_until_gone(marker) == []


@pytest.mark.vllm
def test_ctrl_c_while_starting_stops_the_server(tmp_path, target_dir):
    marker = uuid.uuid4().hex
    server = VllmServer(target_dir, log_path=tmp_path / "server.log", env=_server_env(marker))
    # Ctrl-C arrives while __enter__ waits for /health, when __exit__ would never run: one second after the
    # server process exists, long before Python + vLLM imports can finish there.
    def interrupt_soon_after_launch():
        deadline = time.monotonic() + 120
        while server.process is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGINT)

    # A user's Ctrl-C reaches a fresh stage process; this one has run other tests first, so
    # make sure SIGINT is neither blocked nor handled elsewhere here (threads inherit the mask at creation).
    previous_handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    previous_mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    timer = threading.Thread(target=interrupt_soon_after_launch, daemon=True)
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            with server:
                pytest.fail("the server cannot be healthy 1 s after launch")
    finally:
        timer.join(timeout=130)
        signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
        signal.signal(signal.SIGINT, previous_handler)
    assert server.process is None
    assert _wait_until_gone(marker) == []


def test_engine_settings_reach_every_engine_and_the_environment_reaches_every_process():
    from conftest import SMOKE_CONFIG

    from eagle_pipeline.config import load_config
    from eagle_pipeline.engine import (
        MODEL_RUNNER_VARIABLE,
        capture_engine_kwargs,
        drafter_engine_settings,
        drafter_speculative_config,
        engine_env,
        llm_kwargs,
        server_args,
    )

    cfg = load_config(SMOKE_CONFIG, ["device=cuda", "verifier.attention_backend=TRITON_MLA", "verifier.kv_cache_dtype=fp8",
                                     "verifier.model_runner=v1", "serve.drafter_attention_backend=TRITON_MLA",
                                     "env={NCCL_P2P_DISABLE: '1', VLLM_LOGGING_LEVEL: DEBUG}"])
    for kwargs in (llm_kwargs(cfg, "m"), capture_engine_kwargs(cfg)["extra_engine_args"]):
        assert kwargs["attention_backend"] == "TRITON_MLA" and kwargs["kv_cache_dtype"] == "fp8"
    flags = server_args(cfg)
    assert flags[flags.index("--attention-backend") + 1] == "TRITON_MLA" and flags[flags.index("--kv-cache-dtype") + 1] == "fp8"
    assert drafter_speculative_config("/d", 3, drafter_engine_settings(cfg)) == {
        "method": "eagle3", "model": "/d", "num_speculative_tokens": 3, "attention_backend": "TRITON_MLA"}
    env = engine_env(cfg)
    # The config's env wins over the pipeline's own defaults (log level INFO on cuda).
    assert env[MODEL_RUNNER_VARIABLE] == "0" and env["NCCL_P2P_DISABLE"] == "1" and env["VLLM_LOGGING_LEVEL"] == "DEBUG"
    plain = load_config(SMOKE_CONFIG)
    assert MODEL_RUNNER_VARIABLE not in engine_env(plain) and engine_env(plain)["VLLM_LOGGING_LEVEL"] == "WARNING"
    assert engine_env(load_config(SMOKE_CONFIG, ["device=cuda"]))["VLLM_LOGGING_LEVEL"] == "INFO"
    assert drafter_engine_settings(plain) == {}


# ----------------------------------------------------------------------------------------------------
# What the engine logged, the engine probe, and the served record


# Two server starts in one log file (a log folder outlives --force), in the shapes vLLM 0.32 logs them
# (v1/engine/core.py, platforms/cuda.py, config/vllm.py); only the later start counts.
ENGINE_LOG = """\
$ python -m vllm.entrypoints.openai.api_server --model /m --kv-cache-dtype auto
(EngineCore pid=1) INFO 12-06 06:00:00 [core.py:134] Initializing a V1 LLM engine (v0.32.0) with config: model='/m', \
speculative_config=SpeculativeConfig(method='eagle3', model='/d', num_spec_tokens=3), dtype=torch.bfloat16, \
quantization=None, quantization_config=None, enforce_eager=True, aux_output_config=None, kv_cache_dtype=auto, \
device_config=cuda, compilation_config={'mode': <CompilationMode.NONE: 0>, 'cudagraph_mode': <CUDAGraphMode.NONE: 0>}
(EngineCore pid=1) INFO 12-06 06:00:01 [cuda.py:446] Using AttentionBackendEnum.TRITON_MLA backend.
$ python -m vllm.entrypoints.openai.api_server --model /m --kv-cache-dtype fp8
(EngineCore pid=2) INFO 12-06 07:00:00 [core.py:134] Initializing a V1 LLM engine (v0.32.0) with config: model='/m', \
speculative_config=SpeculativeConfig(method='eagle3', model='/d', num_spec_tokens=3), dtype=torch.bfloat16, \
quantization=compressed-tensors, quantization_config={'format': 'pack-quantized', 'bits': 4}, enforce_eager=False, \
aux_output_config=None, kv_cache_dtype=fp8, device_config=cuda, \
compilation_config={'mode': <CompilationMode.VLLM_COMPILE: 3>, 'cudagraph_mode': <CUDAGraphMode.FULL_AND_PIECEWISE: 3>}
(EngineCore pid=2) INFO 12-06 07:00:01 [prefill/selector.py:106] Using FLASHINFER MLA prefill backend.
(EngineCore pid=2) INFO 12-06 07:00:01 [cuda.py:507] Using FLASHINFER_MLA attention backend out of potential backends: \
['FLASHINFER_MLA', 'TRITON_MLA'].
(EngineCore pid=2) INFO 12-06 07:00:02 [cuda.py:507] Using FLASH_ATTN attention backend out of potential backends: \
['FLASH_ATTN', 'TRITON_ATTN'].
"""


def test_engine_facts_are_read_from_the_servers_last_start(tmp_path):
    from eagle_pipeline.serve.engine_facts import read_engine_facts

    log = tmp_path / "server-eagle3.log"
    log.write_text(ENGINE_LOG)
    declared = {"verifier.kv_cache_dtype": "fp8", "serve.drafter_kv_cache_dtype": None, "verifier.model_runner": "auto",
                "env": {}}
    facts = read_engine_facts(log, declared)
    assert facts["target_attention_backend"] == "FLASHINFER_MLA" and facts["drafter_attention_backend"] == "FLASH_ATTN"
    assert facts["kv_cache_dtype"] == "fp8" and facts["quantization"] == "compressed-tensors"
    assert facts["enforce_eager"] == "False" and facts["cudagraph_mode"] == "FULL_AND_PIECEWISE"
    assert facts["model_runner"] == "V2" and facts["vllm_version"] == "v0.32.0"
    summary = facts["summary"]
    assert "target attention backend FLASHINFER_MLA, drafter attention backend FLASH_ATTN, KV-cache dtype fp8" in summary
    assert "model runner V2" in summary and "CUDA graphs FULL_AND_PIECEWISE" in summary
    # The CPU build logs no backend for a non-MLA model and falls back to the V1 runner with a warning.
    log.write_text("$ python -m vllm...\n(EngineCore pid=3) WARNING 12-06 06:32:17 [vllm.py:725] Model Runner V2 requires "
                   "Triton; using the V1 model runner instead.\n")
    cpu = read_engine_facts(log, {**declared, "verifier.attention_backend": None, "verifier.enforce_eager": True})
    assert cpu["model_runner"] == "V1" and "Triton" in cpu["model_runner_reason"]
    assert "target attention backend vLLM's choice, not logged" in cpu["summary"]
    assert "enforce_eager True (declared; not logged)" in cpu["summary"]


def test_declared_engine_settings_are_the_engine_variant_keys_as_the_config_sets_them():
    from conftest import SMOKE_CONFIG

    from eagle_pipeline.config import load_config
    from eagle_pipeline.config.serving import ENGINE_VARIANT_KEYS
    from eagle_pipeline.serve.engine_facts import declared_settings

    cfg = load_config(SMOKE_CONFIG, ["verifier.kv_cache_dtype=fp8", "serve.drafter_attention_backend=TRITON_ATTN",
                                     "env={A: 'off'}"])
    declared = declared_settings(cfg)
    assert tuple(declared) == ENGINE_VARIANT_KEYS
    assert declared["verifier.kv_cache_dtype"] == "fp8" and declared["serve.drafter_attention_backend"] == "TRITON_ATTN"
    assert declared["env"]["A"] == "off" and declared["verifier.model_runner"] == cfg.verifier.model_runner


def test_stage06_servers_log_at_info_unless_the_config_says_otherwise():
    from conftest import SMOKE_CONFIG

    from eagle_pipeline.config import load_config
    from eagle_pipeline.engine import engine_env
    from eagle_pipeline.serve.engine_facts import server_env

    plain = load_config(SMOKE_CONFIG)
    assert server_env(plain, engine_env(plain))["VLLM_LOGGING_LEVEL"] == "INFO"
    for override in ("verifier.log_level=ERROR", "env={VLLM_LOGGING_LEVEL: DEBUG}"):
        cfg = load_config(SMOKE_CONFIG, [override])
        assert server_env(cfg, engine_env(cfg)) == engine_env(cfg)


def test_engine_variants_are_checked_when_the_config_loads():
    from conftest import SMOKE_CONFIG

    from eagle_pipeline.config import load_config

    good = load_config(SMOKE_CONFIG, ["serve.engine_variants=[{verifier.attention_backend: TRITON_MLA, "
                                      "serve.drafter_attention_backend: TRITON_ATTN}, {env: {A: 'off'}}]"])
    assert good.serve.engine_variants[1] == {"env": {"A": "off"}}
    for value, says in (("[{verifier.dtype: float16}]", "unknown key 'verifier.dtype'; allowed: verifier.attention_backend"),
                        ("[{verifier.attention_backend: TRITON_MAL}]", "'TRITON_MAL' is not a vLLM attention backend"),
                        ("[{verifier.model_runner: v3}]", "verifier.model_runner: Input should be"),
                        ("[{env: {A: 1}}]", "env: must map variable names to strings"),
                        ("[{}]", "each entry is a mapping of engine keys")):
        with pytest.raises(BadInput) as refused:
            load_config(SMOKE_CONFIG, [f"serve.engine_variants={value}"])
        line = str(refused.value)
        assert "\n" not in line and "serve.engine_variants: entry 0: " in line and says in line, line


def test_a_variant_overrides_the_engine_keys_of_every_engine_it_starts():
    from conftest import SMOKE_CONFIG

    from eagle_pipeline.config import load_config
    from eagle_pipeline.engine import MODEL_RUNNER_VARIABLE, drafter_engine_settings, server_kwargs
    from eagle_pipeline.serve.engine_probe import describe, variant_config

    cfg = load_config(SMOKE_CONFIG, ["env={KEEP: '1', FAULT: 'on'}"])
    variant = {"verifier.kv_cache_dtype": "fp8", "verifier.model_runner": "v1", "serve.drafter_kv_cache_dtype": "auto",
               "env": {"FAULT": "off"}}
    probed = variant_config(cfg, variant)
    kwargs = server_kwargs(probed)
    assert kwargs["extra_args"][kwargs["extra_args"].index("--kv-cache-dtype") + 1] == "fp8"
    assert kwargs["env"]["FAULT"] == "off" and kwargs["env"]["KEEP"] == "1" and kwargs["env"][MODEL_RUNNER_VARIABLE] == "0"
    assert drafter_engine_settings(probed) == {"kv_cache_dtype": "auto"}
    assert cfg.verifier.kv_cache_dtype == "auto" and cfg.env["FAULT"] == "on"  # the run's own config is untouched
    assert describe(variant) == ("verifier.kv_cache_dtype=fp8, verifier.model_runner=v1, serve.drafter_kv_cache_dtype=auto, "
                                 "env FAULT=off")


def test_the_probe_serves_variants_in_turn_until_one_serves_as_predicted():
    from eagle_pipeline.serve.engine_probe import probe_engine

    served = []

    def serve(index, variant):
        served.append(index)
        if index == 1:
            raise ServerFailed("vLLM server exited with code 1 before becoming healthy; log x:\nTraceback\n"
                               "ValueError: Selected backend TRITON_MLA is not valid for this configuration.\nend")
        figures = {2: [0.1, 0.0, 0.0], 3: [0.79, 0.7, 0.58]}[index]
        return {"per_position_acceptance": figures, "num_drafts": 200, "mean_acceptance_length": 1 + sum(figures)}

    variants = [{"verifier.attention_backend": "TRITON_MLA"}, {"verifier.model_runner": "v1"}, {"env": {"F": "off"}},
                {"verifier.enforce_eager": True}]
    rows = probe_engine(variants, serve, [0.8, 0.7, 0.6], 190, log=lambda *_: None)
    assert served == [1, 2, 3]  # stops at the first that agrees
    assert [row["agrees"] for row in rows] == [False, False, True]
    assert rows[0]["error"] == "ValueError: Selected backend TRITON_MLA is not valid for this configuration."
    assert rows[2]["variant"] == {"env": {"F": "off"}} and rows[2]["text"] == "env F=off"


def test_the_served_record_is_read_back_only_for_the_same_inputs(tmp_path):
    from eagle_pipeline.serve.measure import mode_record, served_report
    from eagle_pipeline.serve.report import read_served, write_served

    record = mode_record(_measurements()["none"])
    write_served(tmp_path, {"serve": "x"}, "none", json.loads(json.dumps(record)))
    stage = SimpleNamespace(dir=tmp_path, kept_whole=lambda path: True)  # each file as the stage's manifest keeps it
    back = read_served(stage, {"serve": "x"}, ["none", "eagle3"], 3)
    assert list(back) == ["none"] and back["none"] == json.loads(json.dumps(record))
    report = served_report(back, num_speculative_tokens=3, temperature=0.0)
    assert report["texts"] == {"none": ["a", "b", "c"]} and report["token_ids"]["none"][0] == (None, None)
    assert read_served(stage, {"serve": "y"}, ["none"], 3) == {}
    assert read_served(SimpleNamespace(dir=tmp_path / "no"), {"serve": "x"}, ["none"], 3) == {}


def test_report_lists_the_worst_prompts_the_engine_and_the_probe():
    from eagle_pipeline.serve.report import per_prompt_acceptance, render_report_md

    report = summarize(_measurements(), num_speculative_tokens=3, temperature=0.0, max_tokens=30, concurrency=1)
    report["modes"]["eagle3"]["per_prompt"] = [
        {"mean_acceptance_length": 2.5, "num_drafts": 10, "per_position_acceptance": [0.8, 0.5, 0.2]},
        {"mean_acceptance_length": 1.2, "num_drafts": 20, "per_position_acceptance": [0.2, 0.0, 0.0]},
        None]
    report.update(prompt_ids=["a", "b", "c"], predicted_per_prompt_mean_acceptance_length=[2.4, 2.2, None],
                  predicted_per_prompt_num_drafts=[9, 12, None])
    report["per_prompt"] = per_prompt_acceptance(report)
    assert report["per_prompt"][1] == {"index": 1, "id": "b", "served_mean_acceptance_length": 1.2, "served_num_drafts": 20,
                                       "predicted_mean_acceptance_length": 2.2, "predicted_num_drafts": 12}
    report["engine"] = {"summary": "target attention backend FLASHINFER_MLA", "log": "x.log"}
    report["diagnosis"] = {"line": "DIAGNOSIS FAIL: engine", "engine_probe": [
        {"index": 1, "text": "verifier.model_runner=v1", "served": None, "error": "ValueError: no", "predicted": [0.8],
         "agrees": False},
        {"index": 2, "text": "env F=off", "served": [0.79], "mean_acceptance_length": 1.79, "predicted": [0.8], "agrees": True}]}
    markdown = render_report_md(report)
    worst = markdown.split("## Worst prompts")[1]
    assert worst.index("| b | 1.20 | 20 | 2.20 | 12 |") < worst.index("| a | 2.50 | 10 | 2.40 | 9 |")
    assert "target attention backend FLASHINFER_MLA (log: x.log)" in markdown
    assert "| 1 | verifier.model_runner=v1 | did not start: ValueError: no |" in markdown
    assert "| 2 | env F=off | 0.79 | 1.79 | 0.80 | yes |" in markdown
