"""The heartbeat's diagnosis, on its real files (one per rank, in a temporary directory) with each
rank's publisher running: a rank whose heartbeat stopped is named; otherwise the ranks behind the others;
otherwise all of them; and with every rank's own watchdog thread (the real arrangement: it
publishes and diagnoses), only the stopped rank is named, whichever ranks diagnose at once.
A finished step is named as finished even when the rank stops before its next heartbeat; an
earlier attempt's files are not read as a live rank; a stopped process is ended with its group.
(Stopping a real job is tests/e2e/test_resilience.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest

from megatron_slmoe.training.reliability.heartbeat import Board, Heartbeat, end_process


@pytest.fixture
def ranks(tmp_path):
    """Three ranks' heartbeats on one board; ``publish(beat)`` keeps a rank's heartbeat going
    (its publishing, without the watchdog that would end this process)."""
    board = Board(str(tmp_path), "attempt")
    # The diagnosis waits 3 intervals for a live rank's heartbeat to move: long enough that a
    # loaded machine (the publishers below are threads of this process) cannot fake a stop.
    beats = [Heartbeat(10.0, board, rank, 3, f"node{rank // 2}", interval_s=0.25)
             for rank in range(3)]
    for beat in beats:
        beat.start()
    stop = threading.Event()
    threads = []

    def publish(beat):
        def loop():
            while not stop.wait(0.01):
                beat._publish()

        threads.append(threading.Thread(target=loop, daemon=True))
        threads[-1].start()

    yield beats, publish
    stop.set()
    for thread in threads:
        thread.join()


def test_a_rank_whose_heartbeat_stopped_is_named(ranks):
    ranks, publish = ranks
    for beat, step in zip(ranks, (7, 7, 6)):
        beat.progress(step)
    ranks[2]._publish()
    publish(ranks[0])
    publish(ranks[1])  # rank 2 publishes nothing more: stopped
    time.sleep(0.1)
    ranks[0]._progress_at = time.monotonic() - 12
    message, culprits = ranks[0]._diagnose(time.monotonic())
    assert [c.rank for c in culprits] == [2]
    assert message.startswith("rank 2 on node node1 (pid ") and "stopped sending heartbeats" in message
    assert "the last step it finished is 6" in message


def test_the_ranks_behind_are_named_when_all_are_alive(ranks):
    ranks, publish = ranks
    for beat, step in zip(ranks, (9, 8, 9)):
        beat.progress(step)
        publish(beat)
    time.sleep(0.1)
    ranks[0]._progress_at = time.monotonic() - 12
    message, culprits = ranks[0]._diagnose(time.monotonic())
    assert [c.rank for c in culprits] == [1]
    assert "rank 1 on node node0" in message and "has not finished a step for 12 s" in message
    assert "the last step it finished is 8, the other ranks' is 9" in message


def test_all_ranks_stuck_at_one_step(ranks):
    ranks, publish = ranks
    for beat in ranks:
        beat.progress(4)
        publish(beat)
    time.sleep(0.1)
    ranks[2]._progress_at = time.monotonic() - 30
    message, culprits = ranks[2]._diagnose(time.monotonic())
    assert len(culprits) == 3
    assert message == ("no rank finished a step for 30 s (--heartbeat-timeout 10 s): all 3 ranks "
                       "(nodes node0, node1) are stuck after step 4")


def test_only_the_stopped_rank_is_named_by_the_ranks_that_diagnose(monkeypatch, tmp_path):
    """Each rank's one thread publishes and watches, as in a job. Rank 2 stops (SIGSTOP stops
    its thread); ranks 0 and 1 stop finishing steps (they wait for rank 2 in a collective), so
    both diagnose, each pausing its watch meanwhile: neither may name itself or the other."""
    reports = {}

    def record(self, message, culprits):
        reports[self.rank] = (message, [c.rank for c in culprits])
        self._stop.set()

    monkeypatch.setattr(Heartbeat, "_stop_job", record)
    board = Board(str(tmp_path), "attempt")
    beats = [Heartbeat(2.5, board, rank, 3, f"node{rank}", interval_s=0.25) for rank in range(3)]
    for beat in beats:
        beat.start()
    for beat in beats:
        beat.watch()
        beat.progress(5)
    time.sleep(0.6)
    beats[2].close()  # stopped: publishes nothing more
    deadline = time.monotonic() + 30
    while len(reports) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    for beat in beats:
        beat.close()
    assert sorted(reports) == [0, 1]
    for message, culprits in reports.values():
        assert culprits == [2], message
        assert message.startswith("rank 2 on node node2") and "rank 0" not in message


def test_the_step_named_is_the_last_one_the_stopped_rank_finished(tmp_path):
    """A rank stopped right after a step is named with that step, not with the one its previous
    heartbeat carried (the issue: "the last step it finished is 0" after step 4): a finished
    step is published at once."""
    board = Board(str(tmp_path), "attempt")
    watcher = Heartbeat(10.0, board, 0, 2, "node0", interval_s=0.25)
    stopped = Heartbeat(10.0, board, 1, 2, "node0", interval_s=60)  # its next beat: never
    for beat in (watcher, stopped):
        beat.start()
    for step in range(1, 5):
        stopped.progress(step)
    watcher.progress(4)
    watcher._progress_at = time.monotonic() - 12
    message, culprits = watcher._diagnose(time.monotonic())
    assert [c.rank for c in culprits] == [1], message
    assert message.endswith("the last step it finished is 4"), message


def test_an_earlier_attempts_files_are_not_a_live_rank(tmp_path):
    """A restart reuses the folder: what the previous attempt's ranks left there is not read
    as this attempt's heartbeat, and the one-message claim is per attempt."""
    old = Board(str(tmp_path), "old")
    old.publish(0, {"node": "n", "pid": 1, "seq": 9, "step": 3})
    assert old.read([0])[0].step == 3
    assert old.claim_report() and not old.claim_report()
    new = Board(str(tmp_path), "new")
    assert new.read([0, 1]) == [None, None]
    new.forget_earlier_reports()
    assert new.claim_report() and not new.claim_report()
    assert [p.name for p in tmp_path.glob("reported-*")] == ["reported-new"]


def test_a_stopped_process_is_ended_with_its_group():
    """A stopped process cannot act on SIGTERM; its children (a checkpoint writer) may be stopped
    with it: SIGKILL to its group ends them all."""
    proc = subprocess.Popen(["bash", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    child = int(proc.stdout.readline())
    os.killpg(proc.pid, signal.SIGSTOP)
    end_process(proc.pid)
    assert proc.wait(timeout=10) == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:
        time.sleep(0.05)  # reaped by init once killed
    assert not os.path.exists(f"/proc/{child}") or "Z" in open(f"/proc/{child}/stat").read()
