"""The Mooncake store that carries hidden states from capture servers to trainers (hidden_states.transfer:
mooncake; docs/online.md, "The transfers"): a master, which places objects, and a store, the process that holds
the memory they live in, both from the `mooncake-transfer-engine-non-cuda` wheel (requirements/online.txt)."""

from __future__ import annotations

import ctypes
import importlib.util
import shutil
import socket
import sys
from pathlib import Path
from typing import Any

from eagle_pipeline.child_process import ChildProcess
from eagle_pipeline.config.data import MooncakeSettings
from eagle_pipeline.errors import BadInput
from eagle_pipeline.serve.server import find_free_port
from eagle_pipeline.serve.spec_metrics import read_prometheus, sample_sums

MASTER_PROGRAM = "mooncake_master"
STORE_PROGRAM = "mooncake_client"
# Peers find each other through the master's handshake: no metadata server (etcd, HTTP) to run.
METADATA_SERVER = "P2PHANDSHAKE"
# The trainer's and the connector's own staging memory for one transfer; the states themselves live in the store.
CLIENT_BUFFER_BYTES = 256 * 2**20


def mooncake_problem() -> str | None:
    """Why the Mooncake transfer cannot run on this host, or None."""
    if importlib.util.find_spec("mooncake") is None:
        return "the mooncake package is not installed"
    for program in (MASTER_PROGRAM, STORE_PROGRAM):
        if program_path(program) is None:
            return f"its {program} program is not installed beside {sys.executable}"
    try:  # the wheel's binaries and its Python module link against it even for TCP
        ctypes.CDLL("libibverbs.so.1")
    except OSError:
        return "libibverbs.so.1 (rdma-core) is missing"
    return None


def mooncake_refusal() -> str | None:
    """The error line for a host without the Mooncake transfer (mooncake_problem), or None."""
    problem = mooncake_problem()
    return (f"hidden_states.transfer: mooncake, but {problem}; pip install -r requirements/online.txt (and apt-get "
            f"install libibverbs1, which its binaries load), or use transfer: file" if problem else None)


def require_mooncake() -> None:
    refusal = mooncake_refusal()
    if refusal:
        raise BadInput(refusal)


def program_path(name: str) -> Path | None:
    """One of the wheel's programs: installed beside this interpreter (the environment's bin/)."""
    beside = Path(sys.executable).parent / name
    if beside.is_file():
        return beside
    found = shutil.which(name)
    return Path(found) if found else None


def local_address(settings: MooncakeSettings, master: str) -> str:
    """The address this host's Mooncake clients give their peers."""
    if settings.local_hostname:
        return settings.local_hostname
    host = master.rpartition(":")[0]
    if host in ("127.0.0.1", "localhost"):
        return "127.0.0.1"
    return socket.gethostbyname(socket.gethostname())


def names_this_host(address: str) -> bool:
    """Whether host:port names this machine (an address of it that a socket can bind), so that the capture host
    starts the master the config names."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((socket.gethostbyname(address.rpartition(":")[0]), 0))
    except OSError:  # a name that does not resolve, or an address of another machine
        return False
    return True


def client_config(settings: MooncakeSettings, master: str, writer_threads: int = 4) -> dict[str, Any]:
    """hs_connectors' MooncakeStoreConfig fields for a client of this store (a capture server's connector or a
    trainer): no memory of its own in the store."""
    return {
        "local_hostname": local_address(settings, master),
        "metadata_server": METADATA_SERVER,
        "master_server_address": master,
        "global_segment_size": 0,
        "local_buffer_size": CLIENT_BUFFER_BYTES,
        "protocol": settings.protocol,
        "device_name": settings.device,
        "num_writer_threads": writer_threads,
    }


def read_metrics(metrics_url: str, timeout: float = 5.0) -> dict[str, float]:
    """The master's Prometheus counters and gauges by name."""
    return sample_sums(read_prometheus(metrics_url, timeout))


class MooncakeServices:
    """`with MooncakeServices(settings, log_dir) as services:` runs a master and a store on this host until the
    block ends; `services.master` is the address clients use, `services.metrics_url` the master's metrics (the
    store's capacity and what is allocated in it). Both are child processes of eagle_pipeline/child_process.py
    (their own process groups, stopped with this process)."""

    def __init__(self, settings: MooncakeSettings, log_dir: Path, host: str = "127.0.0.1", rpc_port: int | None = None,
                 start_timeout_s: float = 60.0):
        self.settings = settings
        self.log_dir = Path(log_dir)
        self.host = host  # the address clients reach the master at; other than 127.0.0.1, it listens on every interface
        self.rpc_port = rpc_port
        self.start_timeout_s = start_timeout_s
        self.children: list[ChildProcess] = []
        self.master = ""
        self.metrics_url = ""

    def __enter__(self) -> "MooncakeServices":
        require_mooncake()
        rpc_port, metrics_port, store_port = self.rpc_port or find_free_port(), find_free_port(), find_free_port()
        bind = "0.0.0.0" if self.host != "127.0.0.1" else "127.0.0.1"
        self.master = f"{self.host}:{rpc_port}"
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        try:
            master = self._start("mooncake-master", [str(program_path(MASTER_PROGRAM)), f"--rpc_port={rpc_port}",
                                                     f"--rpc_address={bind}", f"--metrics_port={metrics_port}"])
            master.wait_ready(lambda: read_metrics(self.metrics_url) is not None, self.start_timeout_s,
                              "the Mooncake master to answer")
            store = self._start("mooncake-store", [
                str(program_path(STORE_PROGRAM)), f"--master_server_address={self.master}",
                f"--metadata_server={METADATA_SERVER}", f"--host={local_address(self.settings, self.master)}",
                f"--port={store_port}", f"--global_segment_size={int(self.settings.store_gib * 2**30)}",
                f"--protocol={self.settings.protocol}", f"--device_names={self.settings.device}",
            ])
            store.wait_ready(lambda: read_metrics(self.metrics_url).get("master_total_capacity_bytes", 0) > 0,
                             self.start_timeout_s, "the Mooncake store to join its master", watch=[master])
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def allocated_bytes(self) -> int:
        """Bytes the store holds now (the states in flight)."""
        return int(read_metrics(self.metrics_url).get("master_allocated_bytes", 0))

    def _start(self, name: str, command: list[str]) -> ChildProcess:
        child = ChildProcess(command, self.log_dir / f"{name}.log", name=name, stop_grace_s=10.0)
        self.children.append(child)
        child.start()
        return child

    def stop(self) -> None:
        """The store first (it leaves the master), then the master; SIGKILL after a grace period."""
        for child in reversed(self.children):
            child.stop()
        self.children = []
