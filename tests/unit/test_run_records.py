"""What a run keeps across attempts: metrics.jsonl holds each iteration once (an attempt that
starts at iteration N drops the records after N that a killed attempt left, and a torn last
line), and the attempt records say which rank died, when, and why the others stopped."""

from __future__ import annotations

import json

from megatron_slmoe.training.reliability.attempts import describe
from megatron_slmoe.training.reporting.metrics import MetricsWriter


def test_a_resumed_run_rewrites_metrics_from_its_iteration(tmp_path):
    lines = [json.dumps({"iteration": i, "loss": 10.0 - i}) for i in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"iteration": 6, "lo')
    writer = MetricsWriter(str(tmp_path), tensorboard=False, start_iteration=3)
    writer.write({"iteration": 4, "loss": 1.5})
    writer.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records == [{"iteration": 1, "loss": 9.0}, {"iteration": 2, "loss": 8.0},
                       {"iteration": 3, "loss": 7.0}, {"iteration": 4, "loss": 1.5}]


def test_a_fresh_start_keeps_nothing_of_a_killed_attempt(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"iteration": 1, "loss": 3.0}\n')
    MetricsWriter(str(tmp_path), tensorboard=False, start_iteration=0).close()
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_the_previous_attempt_in_one_line():
    previous = {"attempt": 4, "ranks": 3, "finished": False,
                "silent": [{"rank": 1, "node": "n1", "pid": 77}],
                "ended": [{"rank": 0, "node": "n0", "pid": 70, "ended": 1_700_000_000.0,
                           "step": 12, "reason": "RuntimeError: Connection reset by peer"},
                          {"rank": 2, "node": "n1", "pid": 78, "ended": 1_700_000_001.0,
                           "step": 12, "reason": "finished"}]}
    line = describe(previous)
    assert "\n" not in line
    assert line.startswith("attempt 4 of this run failed: rank 1 on node n1 (pid 77) ended "
                           "without a word before ")
    assert "rank 0 on node n0 stopped at " in line
    assert "after step 12: RuntimeError: Connection reset by peer" in line
    assert "rank 2" not in line  # it finished
