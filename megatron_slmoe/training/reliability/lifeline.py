"""How a worker process ends when it is told to, or when nobody is left to tell it.

torchrun starts every worker in a session of its own, so a launcher or agent killed with SIGKILL
(or a terminal that closes) leaves the workers running, still writing into the output directory.
A worker watches its parent and exits once the parent is gone (it is then re-parented, so
``os.getppid()`` changes). The checkpoint writer process of a rank does the same with its trainer.

SIGTERM (torchrun stopping the other ranks after one failed, or a person) ends a worker at once,
even while its main thread waits inside a collective, after a last word for the next attempt.

Bad input that a run meets only once it has started (a damaged data shard, an adapter that does
not fit) would fail every restart the same way: the rank that meets it records its one line in
the file the launcher names (``$SLMOE_END_REPORT``) and stops its torchrun agent, which ends the
job instead of spending the restart budget; the launcher prints that line and exits with code 2
(``python -m megatron_slmoe.training.reliability.lifeline --input-error FILE``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from typing import Callable, Optional

from megatron_slmoe.utils.atomic import write_json_atomic

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


END_REPORT_ENV = "SLMOE_END_REPORT"
"""The file the launcher reads for the one line of bad input that ended a job (it makes a fresh
one per job, outside the output directory); without it, ``<output dir>/attempts/input_error.json``."""


def _report_path(output_dir: str) -> str:
    return os.environ.get(END_REPORT_ENV) or os.path.join(output_dir, "attempts",
                                                          "input_error.json")


def end_job_for_input_error(output_dir: str, message: str) -> None:
    """Record ``message`` (one line; the first rank's stays) and stop this node's torchrun agent
    so that it does not restart the job; the caller then exits with its error."""
    path = _report_path(output_dir)
    try:
        if not os.path.exists(path) or not os.path.getsize(path):
            write_json_atomic(path, {"error": " ".join(message.split()), "time": time.time(),
                                     "pid": os.getpid()})
    except OSError:
        pass  # the output directory itself may be the problem: the error still ends the job
    if under_torchrun():
        try:
            os.kill(os.getppid(), signal.SIGTERM)
        except OSError:
            pass


def input_error(output_dir: str) -> Optional[str]:
    """The one line of the bad input that ended the job (None when none did)."""
    try:
        with open(_report_path(output_dir), encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record.get("error") if isinstance(record, dict) else None


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="the launcher's reading of a job's end")
    parser.add_argument("--input-error", metavar="REPORT", required=True,
                        help=f"the file the job was given as ${END_REPORT_ENV}")
    args = parser.parse_args(argv)
    os.environ[END_REPORT_ENV] = args.input_error
    message = input_error("")
    if message is None:
        return 1
    print(message)
    return 0


if __name__ == "__main__":
    sys.exit(main())
