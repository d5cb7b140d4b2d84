"""The realistic-shapes benchmark's short version (shapes scaled down) runs end to end, so that it
cannot rot: a random checkpoint is made, the engine's levers and transformers + PEFT train on the
same rows, this engine's MoE layer and Megatron-Core's with per-expert LoRA train one step each
side by side, the kernel rows are timed, and the JSON holds every row the README's table reads.
(Figures are the full run's, in the README; no timing is asserted here.)"""

import json
import math
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_short_realistic_benchmark_writes_every_row(tmp_path):
    out = tmp_path / "realistic.json"
    proc = subprocess.run([sys.executable, "tools/bench/realistic.py", "--quick", "--json",
                           str(out), "--work-dir", str(tmp_path / "work")], cwd=REPO,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = report["rows"]
    engine = [r for r in rows if r["system"] == "slmoe" and r.get("tokens_per_s")]
    assert {r["lever"] for r in engine} == {"ep2", "ep2-distopt"}
    assert len(engine) == 4  # two ranks each
    for row in engine:
        assert row["predicted_peak_bytes"] > 0 and row["measured_peak_bytes"] > 0
        assert abs(row["relative_error"]) < 0.5, row  # the planner, scaled down (README: full)
        assert row["rss_after_import_bytes"] > row["shard_bytes"] > 0
        assert all(math.isfinite(loss) for loss in row["losses"])
        assert 0 < row["mfu"] < 1
    assert engine[0]["stage_share"] and abs(sum(engine[0]["stage_share"].values()) - 1) < 1e-6
    distopt = [r for r in engine if r["lever"] == "ep2-distopt"]
    plain = [r for r in engine if r["lever"] == "ep2"]
    # The distributed optimizer shards Adam's state over the two data-parallel ranks.
    assert distopt[0]["predicted_peak_bytes"] < plain[0]["predicted_peak_bytes"]
    planned = {r["lever"]: r for r in rows if r.get("status", "").startswith("not run")}
    assert set(planned) == {"ep2-megatron-fsdp-optim_grads", "ep2-megatron-fsdp-optim_grads_params"}
    assert all("needs CUDA" in r["status"] for r in planned.values())
    assert all(r["predicted_peak_bytes"] > 0 for r in planned.values())
    assert planned["ep2-megatron-fsdp-optim_grads"]["predicted_peak_bytes"] <= \
        plain[0]["predicted_peak_bytes"]
    (peft,) = [r for r in rows if r["system"] == "peft"]
    assert peft["params_trainable"] > 0 and peft["tokens_per_s"] > 0
    layer = {r["lever"]: r for r in rows if r["system"] == "layer"}
    assert set(layer) == {"slmoe", "megatron_lora", "megatron_mask_loop", "moe_floor"}
    # The Megatron-Core baselines trained the same model: their losses matched before timing.
    assert all(layer[v]["status"] == "ok" for v in ("megatron_lora", "megatron_mask_loop"))
    assert report["ratios"]["tokens_per_s_layer_slmoe_over_megatron_lora"] > 0
    kernel = [r for r in rows if r["system"] == "kernel"]
    assert {r["variant"] for r in kernel} == {"fused", "separate"}
    assert all(r["of_dense_fwd_bwd"] > 0 for r in kernel if r["status"] == "ok")
    assert report["ratios"]["tokens_per_s_slmoe_over_peft"] > 0


def test_a_bad_set_is_the_checkpoint_commands_one_line_and_leaves_no_folder(tmp_path):
    """--set goes to slmoe-make-hf-checkpoint: its one line and exit code come through (they were
    hidden in a CalledProcessError), and the run's own work folder is removed."""
    import os

    proc = subprocess.run([sys.executable, "tools/bench/realistic.py", "--quick", "--set",
                           "vocab_size=abc", "--json", str(tmp_path / "r.json")], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        "error: --preset qwen3-30b-a3b with --set: vocab_size must be an integer >= 1, got 'abc'"]
    assert sorted(p.name for p in tmp_path.iterdir()) == []
