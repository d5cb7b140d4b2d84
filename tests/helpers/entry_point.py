"""Run the fine-tuning entry point as users run it (torchrun, a fresh process group) and read what
a run wrote."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def torchrun(nproc: int, args: list[str], wait: bool = True):
    """``torchrun --standalone --nproc-per-node N -m megatron_slmoe.training.finetune ARGS``: its
    output (asserting exit code 0), or with ``wait=False`` the running process (own session)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(nproc), "-m", "megatron_slmoe.training.finetune", *args]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    if not wait:
        return proc
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    return out


def losses(run_dir: Path) -> dict[int, float]:
    """Iteration -> loss; a resumed run rewrites iterations after its checkpoint: last one wins."""
    result = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        result[record["iteration"]] = record["loss"]
    return result
