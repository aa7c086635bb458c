"""A stop during training (eagle_pipeline/train/stop.py, patches/speculators_stop.py): real signals to this
process and to a stand-in for torch.distributed.run. Stage 04 stopped for real: tests/test_faults_04_06.py."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO

from eagle_pipeline.errors import Terminated
from eagle_pipeline.stage import _raise_terminated
from eagle_pipeline.train.stop import GracefulStop


def _validation(epoch: int) -> logging.LogRecord:
    return logging.LogRecord("speculators.metrics", logging.INFO, __file__, 0, {"val": {"loss_epoch": 1.0}, "epoch": epoch},
                             None, None)


def test_a_stop_while_an_epoch_trains_is_at_once_and_one_while_its_checkpoint_completes_waits_for_it():
    previous = signal.signal(signal.SIGTERM, _raise_terminated)  # the stage's own handler, as stage.main sets it
    reached = []
    try:
        with pytest.raises(Terminated), GracefulStop() as stop:
            stop.epoch_started(0)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
            reached.append("past the stop during training steps")
        assert reached == [] and signal.getsignal(signal.SIGTERM) is _raise_terminated  # restored

        with pytest.raises(Terminated), GracefulStop() as stop:
            stop.epoch_started(1)
            stop.epoch_trained(1)  # saved and validated next: the stop waits for the validation record
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)
            reached.append(stop.requested)
            stop.emit(_validation(1))  # the metrics recorder marked the checkpoint complete before this handler
            reached.append("past the complete checkpoint")
        assert reached == [signal.SIGTERM]

        with pytest.raises(KeyboardInterrupt) as twice, GracefulStop() as stop:
            stop.epoch_trained(2)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)
            reached.append("deferred")
            os.kill(os.getpid(), signal.SIGINT)  # asked again: at once, the epoch's checkpoint left torn
            time.sleep(1)
            reached.append("past the second stop")
        assert reached == [signal.SIGTERM, "deferred"] and not isinstance(twice.value, Terminated)

        # Training that fails because of the stop (a DataLoader worker killed with its group) is the stop.
        with pytest.raises(Terminated), GracefulStop() as stop:
            stop.epoch_trained(3)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)
            raise RuntimeError("DataLoader worker (pid 1234) is killed by signal: Terminated")
    finally:
        signal.signal(signal.SIGTERM, previous)


FAKE_TORCHRUN = """
import signal, sys, time
got = []
signal.signal(signal.SIGTERM, lambda *a: got.append("TERM"))
signal.signal(signal.SIGINT, lambda *a: got.append("INT"))
open(sys.argv[1], "w").write("ready")
while not got:
    time.sleep(0.05)
time.sleep(1.0)  # the ranks complete their epoch
open(sys.argv[1], "w").write(",".join(got))
sys.exit(3)
"""


def test_torchrun_gets_a_stop_once_and_is_waited_for(tmp_path):
    from eagle_pipeline.train.launch import run_torchrun

    record = tmp_path / "record"
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        process_group = os.getpgrp()
        timer = subprocess.Popen([sys.executable, "-c", (
            "import os, signal, sys, time, pathlib\n"
            f"p = pathlib.Path({str(record)!r})\n"
            "while not p.exists(): time.sleep(0.02)\n"
            f"os.kill({os.getpid()}, signal.SIGTERM)\n")], start_new_session=True)
        started = time.monotonic()
        with pytest.raises(Terminated):
            run_torchrun([sys.executable, "-c", FAKE_TORCHRUN, str(record)], cwd=REPO)
        timer.wait(timeout=30)
        # Passed on once (it runs in a session of its own: a signal to this group would not reach it), and its
        # end was waited for before the stop was raised here.
        assert record.read_text() == "TERM"
        assert time.monotonic() - started >= 1.0
        assert os.getpgrp() == process_group
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_the_stop_patch_relies_on_the_speculators_it_was_written_for():
    from patches import speculators_stop
    from patches.upstream import changed_sources

    assert changed_sources(speculators_stop.UPSTREAM_SOURCE_SHA256) == []
