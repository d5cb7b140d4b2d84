"""How a worker process ends when it is told to, or when nobody is left to tell it.

torchrun starts every worker in a session of its own, so a launcher or agent killed with SIGKILL
(or a terminal that closes) leaves the workers running, still writing into the output directory.
A worker watches its parent and exits once the parent is gone (it is then re-parented, so
``os.getppid()`` changes). The checkpoint writer process of a rank does the same with its trainer.

SIGTERM (torchrun stopping the other ranks after one failed, or a person) ends a worker at once,
even while its main thread waits inside a collective, after a last word for the next attempt.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Callable

ORPHAN_EXIT_CODE = 1
TERMINATED_EXIT_CODE = 128 + signal.SIGTERM


def exit_with_parent(what: str, interval_s: float = 0.5) -> None:
    """Start a daemon thread that ends this process (one line on stderr) once its parent is gone.
    ``what`` names the process in that line (``rank 3``)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent:
                try:  # the output may have gone with the parent (a pipe to a killed tee)
                    sys.stderr.write(f"[lifeline] {what}: its parent process {parent} is gone; "
                                     f"exiting\n")
                    sys.stderr.flush()
                except (OSError, ValueError):
                    pass
                os._exit(ORPHAN_EXIT_CODE)

    threading.Thread(target=watch, name="slmoe-lifeline", daemon=True).start()


def under_torchrun() -> bool:
    """Whether torchrun's agent started this process (its parent is then the agent)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def on_sigterm(last_word: Callable[[], None]) -> None:
    """On SIGTERM, call ``last_word()`` and exit (code 143). Python runs signal handlers only in
    the main thread and only between bytecodes, so a thread also waits on the signal's wakeup
    byte: a main thread blocked in a collective does not delay the exit. Call from the main
    thread."""
    lock = threading.Lock()

    def end(*_args) -> None:
        if lock.acquire(blocking=False):  # once, whichever thread comes first
            try:
                last_word()
            finally:
                os._exit(TERMINATED_EXIT_CODE)

    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.signal(signal.SIGTERM, end)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    # A forked child (a checkpoint writer) has its own fate: SIGTERM's default, its own wakeup.
    os.register_at_fork(after_in_child=_default_sigterm)

    def watch() -> None:
        while True:
            if signal.SIGTERM in os.read(read_fd, 64):
                end()

    threading.Thread(target=watch, name="slmoe-sigterm", daemon=True).start()


def _default_sigterm() -> None:
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
