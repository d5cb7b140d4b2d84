"""The dispatch benchmark runs under torchrun on CPU and writes the rows it promises (its
figures are not asserted: timings do not belong in tests)."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_dispatch_benchmark_writes_rows(tmp_path):
    out = tmp_path / "dispatch.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--standalone",
         "tools/bench/dispatch.py", "--node-size", "2", "--tokens", "32", "--hidden", "64",
         "--latent", "16", "--experts", "16", "--topk", "4", "--routing", "uniform",
         "--reps", "1", "--warmup", "0", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    names = {r["dispatcher"] for r in rows}
    assert {"megatron_allgather", "slmoe_alltoall", "slmoe_alltoall_hierarchical"} <= names
    for row in rows:
        assert row["status"] == "ok", row
        for key in ("dispatcher", "ep_size", "latent", "tokens", "fwd_bwd_ms"):
            assert key in row
    ours = [r for r in rows if r["dispatcher"] == "slmoe_alltoall"]
    full, latent = (next(r for r in ours if r["latent"] is flag) for flag in (False, True))
    # Latent rows are 64/16 = 4x narrower: four times fewer bytes per token.
    assert full["bytes_per_token"] == 4 * latent["bytes_per_token"]
    hier = next(r for r in rows if r["dispatcher"] == "slmoe_alltoall_hierarchical" and r["latent"])
    assert hier["bytes_inter_node"] < latent["bytes_inter_node"]


def test_dispatch_benchmark_rejects_bad_flag():
    proc = subprocess.run([sys.executable, "tools/bench/dispatch.py", "--latent", "999"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--latent must be smaller" in proc.stderr
