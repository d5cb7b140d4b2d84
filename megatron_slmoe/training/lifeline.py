"""A process that ends when its parent does.

torchrun starts every worker in a session of its own, so a launcher or agent killed with SIGKILL
(or a terminal that closes) leaves the workers running, still writing into the output directory.
A worker watches its parent and exits once the parent is gone (it is then re-parented, so
``os.getppid()`` changes). The checkpoint writer process of a rank does the same with its trainer.
"""

from __future__ import annotations

import os
import sys
import threading
import time

ORPHAN_EXIT_CODE = 1


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
