"""Reading the run configuration, ``--help``, ``--print-config`` and refusing a bad flag cost no
torch or Megatron-Core import: a mistyped flag is refused in a fraction of a second, not after
the ~20 s a full import takes on a loaded machine."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Run in a fresh interpreter where importing torch or megatron fails loudly.
BLOCKER = """
import sys
class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'megatron') and name != 'megatron_slmoe' \\
                and not name.startswith('megatron_slmoe.'):
            raise ImportError('imported ' + name)
sys.meta_path.insert(0, Blocked())
from megatron_slmoe.training.finetune import main
sys.exit(main(sys.argv[1:]))
"""


def _finetune(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKER, *argv], capture_output=True, text=True,
                          timeout=120)


def test_help_and_print_config_import_neither_torch_nor_megatron():
    shown = _finetune("--help")
    assert shown.returncode == 0, shown.stderr
    assert "--lora-rank" in shown.stdout
    printed = _finetune("--print-config", "--lora-rank", "4")
    assert printed.returncode == 0, printed.stderr
    assert "rank: 4" in printed.stdout


@pytest.mark.parametrize("argv, named", [
    (["--lora-rnak", "4"], "--lora-rnak"),
    (["--lora-rank", "0", "--validate-only"], "--lora-rank"),
    (["--global-batch-size", "3", "--validate-only"], "--global-batch-size"),
])
def test_a_bad_flag_is_one_line_before_any_heavy_import(argv, named):
    refused = _finetune(*argv)
    assert refused.returncode == 2, refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and named in lines[0], refused.stderr
