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
    try:
        command = parse(argv)
        if command.print_config:
            print(to_yaml(command.run), end="")
            return 0
        from megatron_slmoe.platform import PlatformError, apply_adaptor
        from megatron_slmoe.training.inputs import check_inputs

        try:
            platform = apply_adaptor()
        except PlatformError as err:  # no such device here: the user's setting
            raise ConfigError(str(err)) from None
        check_inputs(command.run, int(os.environ.get("WORLD_SIZE", "1")), platform)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RunFinished as done:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"[finetune] {done}")
        return EXIT_NOTHING_TO_DO if command.validate_only else 0
    if command.validate_only:
        return 0
    from megatron_slmoe.training.engine import Engine

    engine = Engine(command.run, platform)
    from megatron_slmoe.training.lifeline import exit_with_parent, on_sigterm, under_torchrun

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

    try:
        return engine.run()
    except StorageError as err:  # a store that stayed unusable past its retries: one line
        log.error("error: %s", err)
        return 1


if __name__ == "__main__":
    sys.exit(main())
