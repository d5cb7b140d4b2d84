"""LoRA fine-tuning of a Stable Latent MoE model on Megatron-Core (the main training entry point).

    torchrun --nproc-per-node 2 -m megatron_slmoe.training.finetune --expert-model-parallel-size 2 ...

This module is the command: it parses and checks the command line and the inputs (a mistake is
one ``error:`` line and exit code 2, before torch is imported for a flag mistake), then hands the
run to ``training.engine.Engine`` (Megatron-Core does the work; a task brings the data, callbacks
the other concerns of a run). Inputs may be read from object storage (``s3://``, ``msc://``) and
outputs mirrored to it (``--output-url``; megatron_slmoe.storage).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Optional

from megatron_slmoe.config.errors import ConfigError
from megatron_slmoe.training.cli import parse_command_line, to_yaml
from megatron_slmoe.training.config import RunFinished, validate_run
from megatron_slmoe.utils.errors import InputError

log = logging.getLogger("megatron_slmoe.training")


def parse(argv: Optional[list[str]] = None):
    """The entry point's command line (flags and ``--config`` YAML) -> ``CommandLine``; raises
    ConfigError. The layout rules are checked against $WORLD_SIZE unless only printing."""
    command = parse_command_line(argv, prog="megatron_slmoe.training.finetune",
                                 description=__doc__.strip().split("\n")[0], world_size=0)
    if not command.print_config:
        validate_run(command.run, int(os.environ.get("WORLD_SIZE", "1")))
    return command


EXIT_NOTHING_TO_DO = 3
"""``--validate-only``'s exit code when the run in --output-dir has already finished (the launcher
then starts nothing)."""


def main(argv: Optional[list[str]] = None) -> int:
    os.umask(os.umask(0) | 0o002)  # nothing a run writes is world-writable, whatever the umask
    command = None
    try:
        command = parse(argv)
        if command.print_config:
            print(to_yaml(command.run), end="")
            return 0
        from megatron_slmoe.platform import PlatformError, apply_adaptor
        from megatron_slmoe.training.inputs import prepare_run

        try:
            platform = apply_adaptor()
        except PlatformError as err:  # no such device here: the user's setting
            raise ConfigError(str(err)) from None
        prepared = prepare_run(command.run, int(os.environ.get("WORLD_SIZE", "1")), platform)
    except InputError as err:
        return _refuse(str(err), command.run.output.output_dir if command else "")
    except RunFinished as done:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"[finetune] {done}")
        return EXIT_NOTHING_TO_DO if command.validate_only else 0
    if command.validate_only:
        return 0
    from megatron_slmoe.training.recipe import build_engine

    engine = build_engine(prepared, platform)  # opens none of the inputs again
    from megatron_slmoe.training.reliability.lifeline import (
        exit_with_parent,
        on_sigterm,
        under_torchrun,
    )

    if under_torchrun():  # torchrun's workers run in sessions of their own: end with the agent
        exit_with_parent(f"rank {os.environ.get('RANK', '?')}")
        on_sigterm(engine.terminated)
    # Our progress lines and data summaries from rank 0; everyone's warnings; not Megatron's
    # INFO chatter (it prints whole configs). No credential reaches a log line.
    from megatron_slmoe.utils.redact import install_log_redaction

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    install_log_redaction()
    if int(os.environ.get("RANK", "0")) == 0:
        logging.getLogger("megatron_slmoe").setLevel(logging.INFO)
    from megatron_slmoe.storage import StorageError
    from megatron_slmoe.training.reliability.failures import failure_that_repeats, keep_traceback
    from megatron_slmoe.training.reliability.lifeline import input_error

    try:
        return engine.run()
    except Exception as err:  # noqa: BLE001  (sorted below: a failure that repeats, or not)
        output_dir = engine.run_config.output.output_dir or ""  # resolved at set-up
        message = failure_that_repeats(err, output_dir)
        if message is None and not (output_dir and input_error(output_dir)):
            if not isinstance(err, StorageError):
                raise  # a fault a restart may cure, or a bug: its traceback, and the budget
            log.error("error: %s", err)  # a store unusable past its retries: one line
            return 1
        # The job ends (the engine stopped torchrun's restarts and kept the traceback in the
        # attempt log); a rank that failed because another did (a collective cut short) keeps
        # its traceback there too and says nothing.
        if message:
            return _refuse(message, output_dir)
        keep_traceback(output_dir, err)
        return 2


def _refuse(message: str, output_dir: str) -> int:
    """A failure that would repeat, found by this rank: one ``error:`` line (the launcher prints
    it once for the job when it started it) and exit code 2; under torchrun, the job ends
    instead of being restarted."""
    from megatron_slmoe.training.reliability.lifeline import (
        END_REPORT_ENV,
        end_job_for_input_error,
        under_torchrun,
    )

    if under_torchrun() and (output_dir or os.environ.get(END_REPORT_ENV)):
        end_job_for_input_error(output_dir, message)
    if not (under_torchrun() and os.environ.get(END_REPORT_ENV)):
        print(f"error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
