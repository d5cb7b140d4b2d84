"""The heartbeat's diagnosis, on a real key-value store (torch's HashStore) with each rank's
publisher running: a rank whose heartbeat stopped is named; otherwise the ranks behind the others;
otherwise all of them; and with every rank's own watchdog thread (the real arrangement: it
publishes and diagnoses), only the stopped rank is named, whichever ranks diagnose at once.
(Stopping a real job is tests/e2e/test_resilience.py.)"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from megatron_slmoe.training.heartbeat import Heartbeat


@pytest.fixture
def ranks():
    """Three ranks' heartbeats on one store; ``publish(beat)`` keeps a rank's heartbeat going
    (its publishing, without the watchdog that would end this process)."""
    store = torch.distributed.HashStore()
    # The diagnosis waits 3 intervals for a live rank's heartbeat to move: long enough that a
    # loaded machine (the publishers below are threads of this process) cannot fake a stop.
    beats = [Heartbeat(10.0, store, rank, 3, f"node{rank // 2}", interval_s=0.25)
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


def test_only_the_stopped_rank_is_named_by_the_ranks_that_diagnose(monkeypatch):
    """Each rank's one thread publishes and watches, as in a job. Rank 2 stops (SIGSTOP stops
    its thread); ranks 0 and 1 stop finishing steps (they wait for rank 2 in a collective), so
    both diagnose, each pausing its watch meanwhile: neither may name itself or the other."""
    reports = {}

    def record(self, message, culprits):
        reports[self.rank] = (message, [c.rank for c in culprits])
        self._stop.set()

    monkeypatch.setattr(Heartbeat, "_stop_job", record)
    store = torch.distributed.HashStore()
    beats = [Heartbeat(2.5, store, rank, 3, f"node{rank}", interval_s=0.25) for rank in range(3)]
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
