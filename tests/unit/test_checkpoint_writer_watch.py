"""The persistent checkpoint writer's watch (``training.async_checkpoint.WriterWatch``): a writer
that ends while the run still needs it ends its rank with one line naming how it ended (Megatron's
trainer side would otherwise wait for it for ever); a writer stopped on purpose does not. Real
processes; the rank's exit is replaced by a recorder. (The writer saving, resuming and finishing
a real run: tests/e2e/test_resilience.py.)"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

from megatron_slmoe.training.async_checkpoint import WriterWatch


def _exit_with(code: int) -> None:
    os._exit(code)


def _sleep() -> None:
    time.sleep(60)


def _watched(target, *args):
    process = multiprocessing.get_context("fork").Process(target=target, args=args)
    process.start()
    lines: list[str] = []
    called = threading.Event()
    watch = WriterWatch(process, 3, on_death=lambda line: (lines.append(line), called.set()))
    return process, watch, lines, called


def test_a_writer_that_dies_ends_its_rank_with_one_line():
    process, _, lines, called = _watched(_exit_with, 7)
    assert called.wait(10)
    assert lines == [f"[checkpoint] rank 3: its checkpoint writer (pid {process.pid}) ended "
                     f"(exit code 7) while the run still needed it; the rank stops (the newest "
                     f"complete checkpoint is intact)"]


def test_a_killed_writer_is_named_by_its_signal():
    process, _, lines, called = _watched(_sleep)
    os.kill(process.pid, signal.SIGKILL)
    assert called.wait(10)
    assert "ended (killed by signal 9)" in lines[0]


def test_a_writer_stopped_on_purpose_ends_nothing():
    process, watch, lines, called = _watched(_sleep)
    watch.closing()
    process.kill()  # what close(abort=True) does
    process.join()
    assert not called.wait(1) and lines == []
