"""A capture server for trainers elsewhere: `python -m eagle_pipeline.online.serve_capture --config C` starts the
target's vLLM server with the capture method and the config's transfer (and, for transfer: mooncake without a
master or with one on this host, a Mooncake master and store beside it), checks nothing about data, and serves
until SIGTERM or Ctrl-C, started again if it dies. `scripts/remote.sh capture CONFIG` runs it detached on a host.

The trainer's host names it in the same config, as it prints; with transfer file or fp8 both hosts must see the
run folder at the same path (docs/online.md, "Capture servers on another host").

On `device: cuda` it holds the locks of the GPUs it may use, as the stages do (eagle_pipeline/locks.py), until it
stops. Exit codes as the stages': 2 for bad input (one `error:` line), 1 for a failure, 0 when stopped.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import time
from contextlib import ExitStack

from eagle_pipeline import locks
from eagle_pipeline.config import load_config
from eagle_pipeline.engine import apply_engine_env
from eagle_pipeline.errors import BadInput
from eagle_pipeline.online import mooncake as mc
from eagle_pipeline.online.servers import CaptureServer, free_share_reader, server_kwargs_for
from eagle_pipeline.samples import planned_sample_layout
from eagle_pipeline.verifier import Verifier


def serve(config: str, overrides: list[str], port: int, host: str, mooncake_port: int) -> None:
    cfg = load_config(config, overrides)
    hs = cfg.hidden_states
    if hs.mode != "online":
        raise BadInput("hidden_states.mode: a capture server serves online runs; set mode: online in the config")
    apply_engine_env(cfg)
    verifier = Verifier.from_config(cfg)
    layout = planned_sample_layout(cfg, verifier.num_layers, verifier.hidden_size, verifier.vocab_size)
    address = host if host not in ("0.0.0.0", "") else socket.gethostbyname(socket.gethostname())
    own = cfg.run_dir / "capture_server"  # its logs, and the states in flight of the file and fp8 transfers
    logs = own / "logs"
    with ExitStack() as stack:
        if cfg.device == "cuda":  # the GPUs the stages lock: a server left running is named to stage 06, not hit
            held = stack.enter_context(locks.HeldLocks())
            locks.take_gpu_locks(locks.holder_record(run=cfg.run_name, stage="capture_server"), held)
        mooncake_client, storage = None, None
        if hs.transfer == "mooncake":
            master = hs.mooncake.master
            if master is None or mc.names_this_host(master):
                host_part, port_part = master.rsplit(":", 1) if master else (address, str(mooncake_port))
                services = stack.enter_context(mc.MooncakeServices(hs.mooncake, logs, host=host_part,
                                                                   rpc_port=int(port_part)))
                master = services.master
                print(f"Mooncake master {master} and a {hs.mooncake.store_gib:g} GiB store: set "
                      f"hidden_states.mooncake.master: {master} on the trainer's host", flush=True)
            mooncake_client = mc.client_config(hs.mooncake, master)
        else:
            storage = own / "states"
            storage.mkdir(parents=True, exist_ok=True)
        kwargs = server_kwargs_for(cfg, verifier, layout, storage=storage, mooncake_client=mooncake_client,
                                   longest_sequence=hs.max_seq_len, listen_host=host)
        server = stack.enter_context(CaptureServer(kwargs, logs / "capture-server.log", port=port,
                                                   startup_timeout_s=cfg.serve.startup_timeout_s,
                                                   restart_share=free_share_reader(cfg)))
        print(f"capture server http://{address}:{server.port}/v1 (transfer {hs.transfer}, aux layer ids "
              f"{list(layout.layer_ids)} + final layer {layout.num_layers}; log {logs / 'capture-server.log'}): set "
              f"hidden_states.capture_endpoints: [http://{address}:{server.port}/v1] on the trainer's host", flush=True)
        while not server.gave_up:
            time.sleep(1.0)
        raise RuntimeError(f"the capture server died {server.restarts + 1} times; see {logs / 'capture-server.log'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle_pipeline.online.serve_capture", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the run config (the same file the trainer's host uses)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--port", type=int, default=8000, help="the server's port (default 8000)")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: every interface)")
    parser.add_argument("--mooncake-port", type=int, default=50051, help="the Mooncake master's port when started here")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stops as Ctrl-C does
    try:
        serve(args.config, args.overrides, args.port, args.host, args.mooncake_port)
    except BadInput as e:
        print("error: " + " ".join(str(e).splitlines()), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("capture server stopped", file=sys.stderr)
        return 0
    except Exception as e:  # noqa: BLE001 - one line, exit 1, like the stages
        print(f"failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
