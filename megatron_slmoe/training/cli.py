"""Command-line flags and ``--config`` YAML, both generated from the run configuration tree.

Precedence: a field's default < the ``--config`` YAML < the command line. The YAML has one
mapping per section, keyed by field name, exactly as ``--print-config`` (and every run's
``config.yaml``) writes it, so feeding that file back reproduces the run::

    parallel:
      expert_model_parallel_size: 2
    lora:
      rank: 16
      targets: [linear_qkv, linear_fc1, linear_fc2]

Every problem is one ConfigError line (a command line prints it and exits with code 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from dataclasses import dataclass
from typing import Any, NoReturn, Optional, Sequence

import yaml

from megatron_slmoe.config.errors import ConfigError
from megatron_slmoe.training.config import RunConfig, validate_run
from megatron_slmoe.config.schema import hints, settings
from megatron_slmoe.config.yaml_file import describe_yaml_error, load_unique
from megatron_slmoe.config.types import describe, is_list, is_optional, literal_choices, matches, \
    scalar_type
from megatron_slmoe.utils.redact import redact_mapping


class OneLineParser(argparse.ArgumentParser):
    """argparse's own errors (an unknown flag, a value that is not an int) as one line, exit 2;
    usage is for --help."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


@dataclass(frozen=True)
class CommandLine:
    run: RunConfig
    config_file: Optional[str]
    print_config: bool
    validate_only: bool


_METAVARS = {int: "N", float: "X", str: "VALUE"}


def build_parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = OneLineParser(prog=prog, description=description, allow_abbrev=False,
                            usage="%(prog)s [--config YAML] [flags]",
                            argument_default=argparse.SUPPRESS)
    parser.add_argument("--config", metavar="YAML",
                        help="run configuration file, as --print-config writes it; flags win")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved run configuration as YAML and exit")
    parser.add_argument("--validate-only", action="store_true",
                        help="check the configuration and the files it names, then exit (the "
                             "launcher does this before torchrun): 0 ready, 2 bad input, 3 the "
                             "run in --output-dir has finished")
    for section, cls in RunConfig.sections().items():
        group = parser.add_argument_group(section, first_sentence(cls.__doc__ or ""))
        for f in settings(cls):
            _add_flag(group, section, f, hints(cls)[f.name])
    return parser


def first_sentence(doc: str) -> str:
    """A docstring's first sentence, whatever lines it spans (a section's line in --help)."""
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    end = paragraph.find(". ")
    return paragraph if end < 0 else paragraph[:end + 1]


def _add_flag(group, section: str, f, hint: Any, *, dest: Optional[str] = None,
              default: Any = dataclasses.MISSING, help: Optional[str] = None,
              required: bool = False) -> None:
    dest = dest or f"{section}.{f.name}"
    if default is dataclasses.MISSING:
        default = f.default_factory() if callable(f.default_factory) else f.default
    text = help or f.metadata["help"]
    shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else default
    kwargs: dict[str, Any] = {"dest": dest, "help": text if default is None or required
                              else f"{text} [default: {shown}]"}
    if required:
        kwargs["required"] = True
    if hint is bool or (is_optional(hint) and scalar_type(hint) is bool):
        kwargs["action"] = argparse.BooleanOptionalAction
    else:
        kwargs["type"] = scalar_type(hint)
        choices = literal_choices(hint)
        if choices:
            kwargs["choices"] = [c for c in choices if c is not None]
        if is_list(hint):
            kwargs["nargs"] = "+"
        if not choices:
            kwargs["metavar"] = _METAVARS.get(kwargs["type"], "VALUE")
    group.add_argument(f.metadata["flag"], **kwargs)
    for switch, value in f.metadata["switches"].items():
        group.add_argument(switch, dest=dest, action="store_const", const=value,
                           help=f"same as {f.metadata['flag']} {value}")


LAYOUT_FLAGS = ("parallel.tensor_model_parallel_size", "parallel.pipeline_model_parallel_size",
                "parallel.expert_model_parallel_size")
"""The parallel layout's settings, for the commands that build a model in any layout."""


def add_run_flags(group, *names: str, required: Sequence[str] = (),
                  defaults: Optional[dict[str, Any]] = None,
                  helps: Optional[dict[str, str]] = None) -> None:
    """Give another command (slmoe-generate, slmoe-convert-hf, ...) the fine-tune's own flags for
    the run settings ``names`` ("section.field", e.g. "parallel.tensor_model_parallel_size"):
    spelled, typed and documented as there. ``required``, ``defaults`` and ``helps`` override
    per name; a flag's value is ``args.<flag with _>`` (``--model-config`` -> ``model_config``).
    ``run_section(args, section)`` checks them with the section's own rules."""
    sections = RunConfig.sections()
    for name in names:
        section, field_name = name.split(".", 1)
        cls = sections[section]
        f = {f.name: f for f in settings(cls)}[field_name]
        dest = f.metadata["flag"].lstrip("-").replace("-", "_")
        _add_flag(group, section, f, hints(cls)[field_name], dest=dest,
                  default=(defaults or {}).get(name, dataclasses.MISSING),
                  help=(helps or {}).get(name), required=name in required)


def run_section(args: argparse.Namespace, section: str):
    """The section ``section`` of a command's ``add_run_flags`` values (the other fields at their
    defaults), checked by the section's own rules (ConfigError naming the flag)."""
    cls = RunConfig.sections()[section]
    values = {}
    for f in settings(cls):
        dest = f.metadata["flag"].lstrip("-").replace("-", "_")
        if dest in vars(args) and getattr(args, dest) is not None:
            values[f.name] = getattr(args, dest)
    return getattr(build_run_config({section: values}), section)


def read_yaml(path: str) -> dict[str, dict[str, Any]]:
    """The sections of a run-configuration file, each key checked against its field's type."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = load_unique(handle.read())
    except OSError as err:
        raise ConfigError(f"--config {path}: {err.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--config {path}: not a text file (not UTF-8); give the YAML file of "
                          f"a run configuration (--print-config writes one)") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"--config {path}: not valid YAML{describe_yaml_error(err)}") from None
    if data is None:
        return {}
    sections = RunConfig.sections()
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of sections "
                          f"({', '.join(sections)})")
    values: dict[str, dict[str, Any]] = {}
    for section, content in data.items():
        if section not in sections:
            raise ConfigError(f"--config {path}: unknown section {section!r} (the sections are "
                              f"{', '.join(sections)})")
        if not isinstance(content, dict):
            raise ConfigError(f"--config {path}: section {section!r} must be a mapping of fields")
        cls = sections[section]
        known = {f.name: f for f in settings(cls)}
        for key, value in content.items():
            if key not in known:
                raise ConfigError(f"--config {path}: unknown key {section}.{key} (known: "
                                  f"{', '.join(known)})")
            hint = hints(cls)[key]
            if not matches(value, hint):
                raise ConfigError(f"--config {path}: {section}.{key}: {known[key].metadata['flag']}"
                                  f" must be {describe(hint)}, got {value!r}")
        values[section] = dict(content)
    return values


def parse_command_line(argv: Optional[Sequence[str]], *, prog: str, description: str,
                       world_size: Optional[int] = None) -> CommandLine:
    """Flags (and ``--config``) -> the checked run configuration. ``world_size``: check the
    layout rules against it (default: $WORLD_SIZE, else 1); 0 skips those rules."""
    namespace = vars(build_parser(prog, description).parse_args(argv))
    config_file = namespace.pop("config", None)
    print_config = namespace.pop("print_config", False)
    validate_only = namespace.pop("validate_only", False)
    values = read_yaml(config_file) if config_file else {}
    for dest, value in namespace.items():
        section, name = dest.split(".", 1)
        values.setdefault(section, {})[name] = value
    run = build_run_config(values)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size:
        validate_run(run, world_size)
    return CommandLine(run, config_file, print_config, validate_only)


def build_run_config(values: dict[str, dict[str, Any]]) -> RunConfig:
    """A RunConfig from per-section field values (missing ones take their defaults)."""
    try:
        return RunConfig(**{name: cls(**values.get(name, {}))
                            for name, cls in RunConfig.sections().items()})
    except TypeError as err:  # an unknown field name passed in code
        raise ConfigError(str(err)) from None


def to_yaml(run: RunConfig) -> str:
    """The configuration as YAML (``--print-config``, every run's ``config.yaml``). Credentials
    are not settings and URLs holding one are refused; anything that still looks like one is
    masked all the same."""
    header = "# megatron_slmoe run configuration (feed back with --config FILE; flags win)\n"
    return header + yaml.safe_dump(redact_mapping(run.to_dict()), sort_keys=False,
                                   default_flow_style=False)
