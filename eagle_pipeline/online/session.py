"""Stage 04's online part (hidden_states.mode: online) around the training it feeds, in the order of
docs/online.md, "How to run it": services, servers, their checks, kept rows, the watch on the states in flight and
the manifest's summary. The ranks get what they need as `TrainRun.online` (settings.py) and ask the servers
themselves, through speculators' online dataset."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Any

from eagle_pipeline.config.base import redact_url
from eagle_pipeline.online import mooncake as mc
from eagle_pipeline.online.client import CaptureClient, transfer_for
from eagle_pipeline.online.disk import FILE_OVERHEAD_BYTES, PeakWatch, sample_bytes, window_bound
from eagle_pipeline.online.endpoints import ExpectedCapture, check_endpoint, probe_endpoint
from eagle_pipeline.online.kept import KEPT_DIR, capture_kept, keep_count, kept_storage
from eagle_pipeline.online.servers import CaptureServer, capture_metrics, free_share_reader, server_kwargs_for
from eagle_pipeline.online.settings import OnlineTraining, training_ranks
from eagle_pipeline.outputs import folder_bytes
from eagle_pipeline.samples import read_sample, sample_path

SCRATCH_DIR = "capture_scratch"  # where the file and fp8 connectors of local servers write the states in flight


def plan_lines(cfg, num_states: int, hidden_size: int, longest: int) -> list[str]:
    """What a dry run of stage 04 says about the online part."""
    hs = cfg.hidden_states
    servers = (", ".join(map(redact_url, hs.capture_endpoints)) if hs.capture_endpoints
               else "one started on this host by stage 04")
    store = ""
    if hs.transfer == "mooncake":
        store = (f"; Mooncake master {hs.mooncake.master}" if hs.mooncake.master else
                 f"; a Mooncake master and a {hs.mooncake.store_gib:g} GiB store started on this host")
    bound = window_bound(cfg, num_states, hidden_size, longest)
    where = "in the Mooncake store" if hs.transfer == "mooncake" else "on disk"
    return [
        f"  online: hidden states captured live by vLLM and discarded after use (transfer {hs.transfer}{store})",
        f"  capture servers: {servers}",
        f"  window: {hs.online_window} sample(s) in flight per rank x {training_ranks(cfg)} rank(s): at most "
        f"~{bound / 1e9:.3f} GB {where} at once (longest sample {longest} tokens, "
        f"{(sample_bytes(cfg, num_states, hidden_size, 1) - FILE_OVERHEAD_BYTES) / 1e3:.1f} KB/token)",
        f"  every epoch captures every sample again; a server silent for {hs.capture_retry_s:g} s stops training "
        f"(rerun resumes from the last checkpoint)",
    ]


def dataset_rows(data_dir: Path) -> list[dict[str, Any]]:
    """Stage 02's rows as the online part needs them: token ids, loss masks and lengths."""
    from datasets import load_from_disk

    data = load_from_disk(str(data_dir)).with_format(None)
    return [{"input_ids": ids, "loss_mask": mask, "seq_len": n}
            for ids, mask, n in zip(data["input_ids"], data["loss_mask"], data["seq_len"])]


def check_named_endpoints(cfg, verifier, layout, rows: list[dict[str, Any]] | None = None) -> None:
    """hidden_states.capture_endpoints checked before anything is written, dry run included (the session checks
    them again, and probes them, once it runs). Without stage 02's rows (a dry run before it), each server must
    take the longest sample the config allows, as one started with this config does."""
    longest = max(r["seq_len"] for r in rows) if rows else cfg.hidden_states.max_seq_len
    expected = ExpectedCapture.for_run(cfg, verifier, layout, longest)
    for endpoint in cfg.hidden_states.capture_endpoints:
        check_endpoint(endpoint, expected)


class OnlineSession:
    """`with OnlineSession(...) as session:` readies everything an online run's training needs, sets
    `train_run.online`, and watches the states in flight until the block ends; `session.summary()` is the
    manifest's `online` block."""

    def __init__(self, cfg, stage_dir: Path, train_run, verifier, layout, rows: list[dict[str, Any]],
                 val_rows: list[int]):
        self.cfg, self.stage_dir, self.train_run = cfg, Path(stage_dir), train_run
        self.verifier, self.layout, self.rows, self.val_rows = verifier, layout, rows, val_rows
        self.longest = max(r["seq_len"] for r in rows)
        self.scratch = self.stage_dir / SCRATCH_DIR
        self.kept_dir = self.stage_dir / KEPT_DIR
        self.servers: list[CaptureServer] = []
        self.services: mc.MooncakeServices | None = None
        self.watch: PeakWatch | None = None
        self.online: OnlineTraining | None = None
        self.facts: dict[str, Any] = {}
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "OnlineSession":
        try:
            self._start()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        try:  # each server's prompt tokens and prefill seconds (vLLM's own counters, since it last started)
            for endpoint in self.online.endpoints if self.online else []:
                with contextlib.suppress(Exception):
                    self.facts.setdefault("capture", []).append(capture_metrics(endpoint))
        finally:
            self._stack.close()  # the watch, then the servers, then the Mooncake services
        if self.scratch.is_dir():  # states a stopped request left behind
            self.facts["leftover_files"] = sum(1 for _ in self.scratch.glob("*.safetensors"))
            shutil.rmtree(self.scratch, ignore_errors=True)

    def _start(self) -> None:
        hs = self.cfg.hidden_states
        mooncake_client = None
        if hs.transfer == "mooncake":
            master = hs.mooncake.master
            if master is None:
                self.services = self._stack.enter_context(mc.MooncakeServices(hs.mooncake, self.stage_dir / "logs"))
                master = self.services.master
            mooncake_client = mc.client_config(hs.mooncake, master)
        else:
            shutil.rmtree(self.scratch, ignore_errors=True)  # what an earlier, stopped run left in flight
            self.scratch.mkdir(parents=True)
        endpoints = list(hs.capture_endpoints)
        if not endpoints:
            kwargs = server_kwargs_for(self.cfg, self.verifier, self.layout, storage=self.scratch,
                                       mooncake_client=mooncake_client, longest_sequence=self.longest)
            server = self._stack.enter_context(CaptureServer(kwargs, self.stage_dir / "logs" / "capture-server.log",
                                                             startup_timeout_s=self.cfg.serve.startup_timeout_s,
                                                             restart_share=free_share_reader(self.cfg)))
            self.servers.append(server)
            endpoints = [server.endpoint]
        self.online = self.train_run.online or OnlineTraining.from_config(hs)
        self.online.endpoints, self.online.mooncake = endpoints, mooncake_client
        expected = ExpectedCapture.for_run(self.cfg, self.verifier, self.layout, self.longest)
        kept = {row: self.rows[row]["input_ids"] for row in self.val_rows[:keep_count(self.cfg)]}
        probe_ids = next(iter(kept.values()), self.rows[0]["input_ids"])
        transfer = transfer_for(self.online, self.train_run.split_dir / "hidden_states")
        clients, transfer_folders = [], set()
        for endpoint in endpoints:
            self.facts.setdefault("servers", []).append(check_endpoint(endpoint, expected))
            client = CaptureClient(endpoint, expected.served_model, transfer)
            probe_s, params = probe_endpoint(client, probe_ids, num_states=self.layout.num_hidden_states,
                                             hidden_size=self.layout.hidden_size, transfer=hs.transfer)
            self.facts["servers"][-1]["probe_s"] = round(probe_s, 3)
            if "hidden_states_path" in params:  # the folder this server's states land in, as this host sees it
                transfer_folders.add(Path(params["hidden_states_path"]).parent)
            clients.append(client)
        self.facts["kept_captured_now"] = capture_kept(
            clients[0], kept, self.kept_dir, num_states=self.layout.num_hidden_states,
            hidden_size=self.layout.hidden_size, storage_dtype=kept_storage(hs.transfer))
        self.facts["kept_rows"] = sorted(kept)
        self.facts["meaning_check"] = self._check_meaning(sorted(kept), endpoints[0])
        self.train_run.online = self.online  # every rank reads it from launch.json (or in this process)
        if self.services is not None:
            self.watch = self._stack.enter_context(PeakWatch(self.services.allocated_bytes))
        elif transfer_folders:
            self.watch = self._stack.enter_context(PeakWatch(lambda: sum(map(folder_bytes, transfer_folders))))
        # else: a Mooncake store elsewhere, whose master's metrics this host does not know where to read

    def _check_meaning(self, rows: list[int], endpoint: str) -> dict[str, Any] | None:
        """The kept rows' states checked for meaning, as stage 02 checks its own (eagle_pipeline/state_meaning.py): no
        flat slot, and the final slot through the target's own norm and lm_head predicts the answers the target
        wrote, which a server of another target, or of the right one computed wrongly, does not."""
        from eagle_pipeline.state_meaning import CapturedSample, check_meaning, slot_names, target_head_for

        if not rows:
            return None
        samples = []
        for row in rows:
            mask = self.rows[row]["loss_mask"]
            samples.append(CapturedSample(f"row {row} captured by {redact_url(endpoint)}", self.rows[row]["input_ids"],
                                          read_sample(sample_path(self.kept_dir, row))["hidden_states"],
                                          [t for t in range(len(mask) - 1) if mask[t + 1]]))
        return check_meaning(samples, target_head_for(self.verifier),
                             slot_names(self.layout.layer_ids, self.layout.num_layers),
                             greedy=self.cfg.generation.temperature == 0,
                             fix="check that the capture server runs this run's target with its engine settings")

    def summary(self) -> dict[str, Any]:
        """The `online` block of stage 04's manifest."""
        hs = self.cfg.hidden_states
        capture = self.facts.get("capture") or []
        tokens = sum(c["prompt_tokens"] for c in capture)
        seconds = sum(c["prefill_seconds"] for c in capture)
        return {
            "transfer": hs.transfer,
            "endpoints": [redact_url(endpoint) for endpoint in self.online.endpoints] if self.online else [],
            "started_here": {"capture_servers": len(self.servers), "mooncake": self.services is not None},
            "window": hs.online_window,
            "window_bound_bytes": window_bound(self.cfg, self.layout.num_hidden_states, self.layout.hidden_size,
                                               self.longest),
            ("store_peak_bytes" if hs.transfer == "mooncake" else "disk_peak_bytes"):
                self.watch.peak if self.watch is not None else None,
            "kept_rows": self.facts.get("kept_rows", []),
            "kept_captured_now": self.facts.get("kept_captured_now", 0),
            "kept_bytes": folder_bytes(self.kept_dir),
            "meaning_check": self.facts.get("meaning_check"),
            "server_restarts": sum(s.restarts for s in self.servers),
            "capture_tokens": int(tokens),
            "capture_prefill_s": round(seconds, 2),
            "capture_tokens_per_s": round(tokens / seconds, 1) if seconds else None,
            "leftover_files": self.facts.get("leftover_files", 0),
            "servers": self.facts.get("servers", []),
        }
