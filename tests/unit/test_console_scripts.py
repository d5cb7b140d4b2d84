"""Every ``slmoe-*`` command the README names is a console script of setup.py, and each console
script's entry point is a function of the package (the README's commands are all ``slmoe-*``; the
planner had none)."""

import importlib
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _scripts() -> dict[str, str]:
    text = (REPO / "setup.py").read_text()
    return dict(re.findall(r'"(slmoe-[a-z-]+)\s*=\s*([\w.]+:\w+)"', text))


def test_the_readme_commands_are_console_scripts():
    readme = (REPO / "README.md").read_text()  # commands, not paths (s3://models/slmoe-base/)
    named = set(re.findall(r"(?<![/\w-])slmoe-[a-z]+(?:-[a-z]+)*(?![\w/-])", readme))
    assert "slmoe-plan" in named and named <= set(_scripts()), named - set(_scripts())


def test_every_console_script_names_a_function():
    for script, target in _scripts().items():
        module, _, name = target.partition(":")
        assert callable(getattr(importlib.import_module(module), name)), script
