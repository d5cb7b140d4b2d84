"""Pictures of a run and the rank sweep, from run directories as fine-tuning writes them
(metrics.jsonl, summary.json): every PNG a run's numbers allow is a real image; a starving
expert's rows of the expert-load heatmap are black; a run
without metrics is one line and exit code 2; the sweep recommends the smallest rank within its
margin of the best held-out loss, reuses finished runs and draws their curves."""

import json

import pytest
from tests.helpers.entry_point import stand_in_base

STEPS = 40
LAYERS = ("2", "3")


def _write_run(run_dir, final_loss=1.0, accuracy=0.9, drift=True, starving_expert=None):
    """A run directory like fine-tuning writes: one record per step, evaluation every 10."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for step in range(1, STEPS + 1):
        loss = final_loss + 5.0 / step
        layers = {}
        for layer in LAYERS:
            tokens = [100 + 10 * e for e in range(8)]
            if starving_expert is not None:
                tokens[starving_expert] = 0
            layers[layer] = {"tokens_per_expert": tokens, "imbalance": 1.5 + 0.01 * step,
                             "dead_experts_window": 0}
            if drift and step % 10 == 0:
                layers[layer].update(drift_kl=0.01 * step, drift_topk_overlap=1 - 0.005 * step,
                                     drift_load_change=0.003 * step)
        record = {"iteration": step, "loss": loss, "lr": 1e-3, "grad_norm": 1.0 / step,
                  "moe": {"layers": layers, "warnings": []}}
        if step % 10 == 0:
            record.update(eval_loss=loss + 0.1, eval_accuracy=accuracy * step / STEPS,
                          tokens_per_s=1000.0 + step)
        lines.append(json.dumps(record))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (run_dir / "summary.json").write_text(json.dumps(
        {"eval_loss_before": 7.0, "eval_loss_after": final_loss + 0.1 + 5.0 / STEPS,
         "accuracy_before": 0.0, "accuracy_after": accuracy}))
    return run_dir


def test_every_picture_is_a_png_and_a_starving_expert_shows_in_the_heatmap(tmp_path):
    import numpy as np
    from PIL import Image

    from megatron_slmoe.training.reporting.plots import plot_run

    run = _write_run(tmp_path / "run", starving_expert=3)
    paths = plot_run(str(run))
    names = sorted(p.split("/")[-1] for p in paths)
    assert names == sorted(["loss.png", "accuracy.png", "learning_rate.png", "grad_norm.png",
                            "throughput.png", "expert_load.png", "routing_balance.png",
                            "routing_drift.png"])
    for path in paths:
        with Image.open(path) as image:
            assert image.format == "PNG" and image.size[0] >= 800 and image.size[1] >= 400

    # Expert 3 gets nothing: its rows of the heatmap are black, which a run without a starving
    # expert does not have.
    healthy = plot_run(str(_write_run(tmp_path / "healthy")))

    def black_fraction(path):
        with Image.open(path) as image:
            return (np.asarray(image.convert("L")) < 12).mean()

    starving = black_fraction(run / "plots" / "expert_load.png")
    fine = black_fraction([p for p in healthy if p.endswith("expert_load.png")][0])
    assert starving > fine + 0.02, (starving, fine)


def test_a_run_without_drift_or_accuracy_gets_the_pictures_it_can(tmp_path):
    from megatron_slmoe.training.reporting.plots import plot_run

    run = _write_run(tmp_path / "run", drift=False)
    for line_file in (run / "metrics.jsonl",):
        records = [json.loads(l) for l in line_file.read_text().splitlines()]
        for record in records:
            record.pop("eval_accuracy", None)
        line_file.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    (run / "summary.json").write_text(json.dumps({"eval_loss_before": 7.0}))
    names = {p.split("/")[-1] for p in plot_run(str(run))}
    assert "routing_drift.png" not in names and "accuracy.png" not in names
    assert "loss.png" in names and "expert_load.png" in names


def test_plot_run_command_writes_and_refuses_in_one_line(tmp_path, capsys):
    from megatron_slmoe.commands.plot_run import main

    run = _write_run(tmp_path / "run")
    assert main([str(run), "--out-dir", str(tmp_path / "pictures")]) == 0
    assert len(list((tmp_path / "pictures").glob("*.png"))) == 8
    assert main([str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1
    assert "no metrics.jsonl" in err


def test_rank_sweep_recommends_the_smallest_rank_within_the_margin(tmp_path, capsys):
    from PIL import Image

    from megatron_slmoe.commands.rank_sweep import main

    sweep = tmp_path / "sweep"
    finals = {4: 1.30, 8: 1.02, 16: 1.00, 32: 0.995}  # rank 8 is within 2.5% of rank 32
    for rank, final in finals.items():
        _write_run(sweep / f"rank-{rank}", final_loss=final)
    # Finished runs are reused: no base, no training; the fine-tuning flags are still checked.
    base = stand_in_base(tmp_path / "base")
    assert main(["--margin", "0.025", "--output-dir", str(sweep), "--",
                 "--base-checkpoint", str(base)]) == 0
    out = capsys.readouterr().out
    assert out.count("reusing the finished run") == 4
    report = json.loads((sweep / "rank_sweep.json").read_text())
    assert report["recommended_rank"] == 8
    assert [r["within_margin"] for r in report["ranks"]] == [False, True, True, True]
    assert "recommended LoRA rank: 8" in out
    with Image.open(report["picture"]) as image:
        assert image.format == "PNG"
    # A tighter margin picks the larger rank.
    assert main(["--margin", "0.001", "--output-dir", str(sweep), "--",
                 "--base-checkpoint", str(base)]) == 0
    assert json.loads((sweep / "rank_sweep.json").read_text())["recommended_rank"] == 32


@pytest.mark.parametrize("argv, needle", [
    (["--ranks", "4", "4"], "distinct"),
    (["--ranks", "0"], "1..256"),
    (["--", "--lora-rank", "8"], "--lora-rank is set by the sweep"),
    ([], "LoRA needs a trained base model"),
])
def test_rank_sweep_bad_flags_are_one_line(tmp_path, capsys, argv, needle):
    from megatron_slmoe.commands.rank_sweep import main

    if "--" not in argv:
        argv = [*argv, "--"]
    cut = argv.index("--")
    argv = [*argv[:cut], "--output-dir", str(tmp_path), *argv[cut:]]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1
