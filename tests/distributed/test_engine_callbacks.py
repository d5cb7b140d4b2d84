"""The engine's extension point, on 2 gloo ranks (EP=2): a callback passed to
``recipe.build_engine(run, platform, callbacks=[...])`` sees every event in order on every rank,
fills in the step records and the summary, has its state saved with each checkpoint and given back
on resume, and a failure inside it ends the run with the reason recorded for the next attempt."""

import json

from tests.helpers.ranks import run_ranks

ARGS = ["--model-config", "tiny", "--seq-length", "64", "--global-batch-size", "8",
        "--micro-batch-size", "2", "--lr-warmup-iters", "0", "--eval-iters", "1",
        "--eval-interval", "2", "--save-interval", "2", "--log-interval", "2", "--fp32",
        "--no-tensorboard", "--no-plots", "--finetune-mode", "full", "--data-format", "pretrain",
        "--expert-model-parallel-size", "2", "--heartbeat-timeout", "0"]


def engine_run(args: list[str], fail_at: int = 0) -> dict:
    """Engine.run with a recording callback on this pool rank: its events, what it was given
    back from a checkpoint, and how the run ended."""
    import megatron_slmoe
    from megatron_slmoe.training.callbacks.base import Callback
    from megatron_slmoe.training.recipe import build_engine
    from megatron_slmoe.training.finetune import parse

    class Recorder(Callback):
        name = "recorder"

        def __init__(self) -> None:
            self.events, self.loaded, self.promoted, self.steps = [], None, 0, 0

        def setup(self, ctx):
            self.events.append("setup")

        def load_state_dict(self, state):
            self.loaded = state
            self.events.append("load_state_dict")

        def evaluate(self, ctx, record, when):
            self.events.append(f"evaluate {when} at {ctx.iteration}")

        def start(self, ctx, record):
            self.events.append(f"start at {ctx.iteration}")

        def before_step(self, ctx, microbatches):
            self.events.append(f"before_step {ctx.iteration}")

        def after_step(self, ctx, record):
            self.steps += 1
            record["recorder_steps"] = self.steps
            self.events.append(f"after_step {ctx.iteration}")
            if ctx.iteration == fail_at:
                raise RuntimeError("the recorder failed on purpose")

        def checkpoint_promoted(self, path):
            self.promoted += 1

        def state_dict(self):
            return {"steps_seen": self.steps}

        def finish(self, ctx, summary):
            summary["recorder_steps"] = self.steps
            self.events.append("finish")

        def stopped(self, ctx, reason, iteration):
            self.events.append(f"stopped at {iteration}: {reason}")

        def close(self):
            self.events.append("close")

    recorder = Recorder()
    engine = build_engine(parse(args).run, megatron_slmoe.PLATFORM, callbacks=[recorder])
    try:
        ended = engine.run()
    except RuntimeError as err:
        ended = str(err)
    return {"events": recorder.events, "loaded": recorder.loaded, "promoted": recorder.promoted,
            "ended": ended}


def test_a_callback_sees_every_event_saves_its_state_and_resumes(tmp_path):
    out = tmp_path / "run"
    first = run_ranks(engine_run, 2, ep=2, args=[*ARGS, "--train-iters", "4", "--output-dir",
                                                 str(out)])
    expected = ["setup", "evaluate before training at 0", "start at 0",
                "before_step 0", "after_step 1", "before_step 1", "after_step 2",
                "evaluate during training at 2", "before_step 2", "after_step 3",
                "before_step 3", "after_step 4", "evaluate after training at 4", "finish", "close"]
    for rank in first:
        assert rank["ended"] == 0 and rank["events"] == expected and rank["loaded"] is None
        assert rank["promoted"] == 2  # iterations 2 and 4
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["recorder_steps"] for r in records if "loss" in r] == [1, 2, 3, 4]
    # Every progress record has the model FLOPs utilisation beside its tokens/s.
    progress = [r for r in records if "tokens_per_s" in r]
    assert [r["iteration"] for r in progress] == [2, 4]
    assert all(0 < r["mfu"] < 1 for r in progress), progress
    assert json.loads((out / "summary.json").read_text())["recorder_steps"] == 4

    # A longer run in the same directory resumes from iteration 4: the callback gets its state.
    second = run_ranks(engine_run, 2, ep=2, args=[*ARGS, "--train-iters", "6", "--output-dir",
                                                  str(out)])
    for rank in second:
        assert rank["ended"] == 0 and rank["loaded"] == {"steps_seen": 4}
        assert rank["events"][:3] == ["setup", "load_state_dict", "start at 4"]


def test_a_failing_callback_ends_the_run_and_the_attempt_says_why(tmp_path):
    out = tmp_path / "run"
    results = run_ranks(engine_run, 2, ep=2, fail_at=2,
                        args=[*ARGS, "--train-iters", "4", "--output-dir", str(out)])
    for rank in results:
        assert rank["ended"] == "the recorder failed on purpose"
        assert rank["events"][-2:] == [
            "stopped at 2: RuntimeError: the recorder failed on purpose", "close"]
    records = [json.loads(path.read_text()) for path in (out / "attempts" / "0").iterdir()]
    assert len(records) == 2
    assert all(r["reason"] == "RuntimeError: the recorder failed on purpose" and r["step"] == 2
               for r in records)


def nan_run(args: list[str], poison_after: int) -> dict:
    """Engine.run with one weight set to NaN after step ``poison_after`` (0: before training);
    how the run ends and what it left for the launcher."""
    import math
    import os

    import torch

    import megatron_slmoe
    from megatron_slmoe.training.callbacks.base import Callback
    from megatron_slmoe.training.recipe import build_engine
    from megatron_slmoe.training.finetune import parse
    from megatron_slmoe.training.reliability.lifeline import input_error

    def poison(model) -> None:
        with torch.no_grad():
            next(p for n, p in model.named_parameters() if "final_layernorm" in n).fill_(math.nan)

    class Poison(Callback):
        name = "poison"

        def setup(self, ctx):
            if poison_after == 0:
                poison(ctx.model)

        def after_step(self, ctx, record):
            if ctx.iteration == poison_after:
                poison(ctx.model)

    run = parse(args).run
    os.environ.pop("SLMOE_END_REPORT", None)  # the output directory keeps the launcher's line
    try:
        build_engine(run, megatron_slmoe.PLATFORM, callbacks=[Poison()]).run()
        ended = None
    except RuntimeError as err:
        ended = str(err)
    return {"ended": ended, "for_the_launcher": input_error(run.output.output_dir)}


def test_a_nan_loss_stops_the_run_at_its_step_in_one_line(tmp_path):
    """NaN weights (as a damaged base checkpoint holds them) stop the run before training; NaN
    that appears later stops it at the step whose loss it is, before that step's update, and
    neither is left for a restart to replay (the launcher reads the line and exits 2)."""
    before = run_ranks(nan_run, 2, ep=2, poison_after=0,
                       args=[*ARGS, "--train-iters", "4", "--output-dir", str(tmp_path / "a")])
    for rank in before:
        assert rank["ended"].startswith("the held-out loss before training is nan"), rank
        assert rank["for_the_launcher"] == rank["ended"]
    later = run_ranks(nan_run, 2, ep=2, poison_after=2,
                      args=[*ARGS, "--train-iters", "4", "--output-dir", str(tmp_path / "b")])
    for rank in later:
        assert rank["ended"].startswith("step 3: the training loss is nan"), rank
        assert "\n" not in rank["ended"] and rank["for_the_launcher"] == rank["ended"]
    checkpoints = sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir())
    assert "iter_0000002" in checkpoints and "iter_0000004" not in checkpoints
