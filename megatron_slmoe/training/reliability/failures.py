"""Failures that a restart would meet again: told apart from the faults a restart may cure, and
ending the job in one line instead of spending torchrun's restart budget on them (the launcher
reads the line, ``lifeline``); each rank's traceback is kept in the attempt log."""

from __future__ import annotations

import errno
import os
import time
import traceback
from typing import Optional

from megatron_slmoe.training.config import RunConfig
from megatron_slmoe.training.engine import NonFiniteError
from megatron_slmoe.training.reliability.lifeline import end_job_for_input_error
from megatron_slmoe.utils.errors import UNWRITABLE_ERRNOS, InputError


def end_job_if_it_repeats(run: RunConfig, err: BaseException) -> None:
    """What a run's failure does to the job (every rank that fails calls it): one that would
    repeat keeps this rank's traceback (before torchrun stops the rank) and ends the job with its
    one line; any other leaves the job to torchrun's restarts."""
    output_dir = run.output.output_dir
    message = failure_that_repeats(err, output_dir)
    if message and output_dir:
        keep_traceback(output_dir, err)
        end_job_for_input_error(output_dir, message)


def failure_that_repeats(err: BaseException, output_dir: str = "") -> Optional[str]:
    """The one line of a failure that a restart would meet again, or None for a fault that a
    restart may cure (or a bug): bad input (``utils.errors.InputError``: a flag, a damaged or
    changed data shard or stored object, an adapter or LoRA target that does not fit, text
    carrying a model's image tokens), a loss gone NaN (replayed from the newest checkpoint, it goes
    NaN again), and a file that cannot be written or read for good (a read-only or full file
    system, no permission), found anywhere in the error's chain of causes."""
    if isinstance(err, (InputError, NonFiniteError)):
        return " ".join(str(err).split())
    causes, cause = [], err
    while cause is not None and cause not in causes:
        causes.append(cause)
        cause = cause.__cause__ or cause.__context__
    cause = next((c for c in causes if isinstance(c, OSError) and c.errno in UNWRITABLE_ERRNOS),
                 None)
    if cause is None:
        return None
    where = str(cause.filename or output_dir or "a file the run writes")
    if cause.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"no space left on the device of {where} (the newest complete checkpoint is "
                f"intact): free space or lower --keep-last, then rerun to resume")
    if output_dir and os.path.abspath(where).startswith(os.path.abspath(output_dir)):
        return (f"cannot write {where}: {cause.strerror} (the output directory {output_dir} is "
                f"read-only or not writable; the newest complete checkpoint is intact): make it "
                f"writable, then rerun to resume")
    return f"{where}: {cause.strerror}"


def keep_traceback(output_dir: str, err: BaseException) -> None:
    """Append this rank's traceback to ``<output dir>/attempts/rank_<r>.log`` (the terminal
    gets the one line; an unwritable output directory keeps nothing)."""
    if not output_dir:
        return
    rank = int(os.environ.get("RANK", "0"))
    path = os.path.join(output_dir, "attempts", f"rank_{rank:05d}.log")
    text = (f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} rank {rank} pid {os.getpid()} "
            f"restart {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}\n"
            + "".join(traceback.format_exception(err)))
    # One write() on an O_APPEND descriptor: torchrun's SIGTERM, which stops the other ranks as
    # soon as one fails, cannot leave a buffered half of the traceback behind.
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, text.encode("utf-8"))
        finally:
            os.close(fd)
    except OSError:
        pass
