"""Failures of a running job, made on purpose on real processes:

- a rank stopped (SIGSTOP), rank 0 as well as another, ends the job within the heartbeat timeout,
  far below the collective timeout, with one message naming that rank, its node and the last step
  it finished, and no process of the job left (naming a slow rank:
  tests/distributed/test_stragglers.py);
- killing the launcher's whole process group with SIGKILL (nothing can be trapped) ends the
  worker, which torchrun runs in a session of its own;
- Megatron's persistent checkpoint writer saves on 2 ranks with EP=2, and a run resumes from its
  checkpoint with the uninterrupted run's losses;
- kill -9 at a random moment of an asynchronous checkpoint save: the resume starts from the
  newest intact checkpoint and reproduces the uninterrupted run's losses and adapter (one seed;
  ``tools/bench/crash_trials.py`` runs several, and Megatron's persistent writer).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.entry_point import (NO_ANSWERS_NO_PICTURES, REPO, TINY, losses, restart_env,
                                      torchrun, torchrun_command)

HEARTBEAT_TIMEOUT = 10  # the issue asks for the job to end within a minute (it set 20 s; 10 s
# proves the same in half the wait, and a healthy step of the tiny model takes well under 1 s)


def _records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for(condition, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _rank_pids(run: Path, attempt: int = 0) -> dict[int, int]:
    records = {}
    for path in (run / "attempts" / str(attempt)).glob("rank_*.json"):
        record = json.loads(path.read_text())
        records[record["rank"]] = record["pid"]
    return records


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _descendants(root: int) -> set[int]:
    """Every living process below ``root`` (torchrun: its workers, in sessions of their own, and
    their checkpoint writers and queue servers)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


@pytest.mark.parametrize("victim", [0, 1])
def test_a_stopped_rank_ends_the_job_within_the_heartbeat_timeout(tiny_base, tmp_path, victim):
    """SIGSTOP of either rank, rank 0 included (it serves the job's key-value store: the
    heartbeat must not need it), ends the job well within a minute, names the rank and the last
    step it finished, and leaves no process behind, the stopped one included."""
    run = tmp_path / "run"
    args = [*TINY, "--base-checkpoint", str(tiny_base), "--train-iters", "500",
            "--save-interval", "1000", "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT),
            "--output-dir", str(run)]  # DP=2
    proc = subprocess.Popen(torchrun_command(2, args), cwd=REPO, env=restart_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    processes: set[int] = set()
    try:
        _wait_for(lambda: len(_records(run)) >= 2, 300, "two steps")
        processes = _descendants(proc.pid)
        pid = _rank_pids(run)[victim]
        assert pid in processes
        last = _records(run)[-1]["iteration"]
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.time()
        out, _ = proc.communicate(timeout=HEARTBEAT_TIMEOUT + 120)
        ended_after = time.time() - stopped_at
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for leftover in _descendants(proc.pid) | processes:
            if _alive(leftover):
                os.kill(leftover, signal.SIGKILL)
    assert proc.returncode == 1, out[-3000:]  # torchrun: a worker failed, no restart left
    assert "exitcode  : 75" in out, out[-3000:]  # the rank that stopped the job (HANG_EXIT_CODE)
    assert ended_after < 60, ended_after  # against a collective timeout of 30 minutes
    messages = [line for line in out.splitlines() if "[heartbeat]" in line]
    assert len(messages) == 1, out[-3000:]
    assert (f"rank {victim} on node {socket.gethostname()} (pid {pid}) stopped sending "
            f"heartbeats" in messages[0]), messages[0]
    step = int(messages[0].split("the last step it finished is ")[1].split(";")[0])
    # Rank 0 logs a step once both ranks finished it; the stopped rank may have finished one
    # more that rank 0 could not log.
    logged = _records(run)[-1]["iteration"]
    assert last <= logged <= step <= logged + 1, (last, logged, step)
    assert not [p for p in processes if _alive(p)], out[-3000:]
    print(f"\nended {ended_after:.1f} s after the SIGSTOP: {messages[0]}")


def test_killing_the_launcher_ends_its_workers(tiny_base, tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "NPROC_PER_NODE": "1", "MAX_RESTARTS": "0"}  # one worker suffices
    launcher = subprocess.Popen(
        ["bash", "scripts/pretrain_lora.sh", "--no-preflight", *TINY, "--base-checkpoint",
         str(tiny_base), "--train-iters", "500", "--output-dir", str(run)],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    try:
        _wait_for(lambda: len(_records(run)) >= 1, 300, "the first step")
        workers = _rank_pids(run)
        assert len(workers) == 1
        os.killpg(launcher.pid, signal.SIGKILL)  # bash, torchrun, tee: not the workers' sessions
        launcher.wait()
        _wait_for(lambda: not any(_alive(pid) for pid in workers.values()), 30,
                  "the workers to exit")
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    steps = len(_records(run))
    time.sleep(2)
    assert len(_records(run)) == steps  # nobody writes there any more


def test_the_persistent_writer_saves_and_the_run_resumes_from_it(tiny_base, tmp_path):
    """Megatron's persistent checkpoint writer on the issue's layout (2 ranks, EP=2, gloo): it
    used to die at its start on a machine without CUDA and the first save waited for it for
    ever. The run saves, finishes, and a run resumed from one of its checkpoints continues with
    the uninterrupted run's losses (a constant learning rate: the two runs' schedules agree)."""
    args = [*TINY, "--base-checkpoint", str(tiny_base), "--expert-model-parallel-size", "2",
            "--async-save", "--use-persistent-ckpt-worker", "--save-interval", "2",
            "--keep-last", "3", "--lr-decay-style", "constant", "--train-iters", "6",
            *NO_ANSWERS_NO_PICTURES]
    first = tmp_path / "first"
    torchrun(2, [*args, "--output-dir", str(first)])
    saved = first / "checkpoints"
    assert sorted(p.name for p in saved.iterdir() if p.name.startswith("iter_")) == [
        "iter_0000002", "iter_0000004", "iter_0000006"]
    summary = json.loads((first / "summary.json").read_text())
    assert summary["checkpoint"]["persistent_worker"] and summary["steps"] == 6
    resumed = tmp_path / "resumed"
    shutil.copytree(saved / "iter_0000004", resumed / "checkpoints" / "iter_0000004")
    out = torchrun(2, [*args, "--output-dir", str(resumed)])
    assert f"resumed from {resumed / 'checkpoints' / 'iter_0000004'} at iteration 4" in out
    expected, got = losses(first), losses(resumed)
    assert sorted(got) == [5, 6]
    for step in (5, 6):
        assert got[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-7), step
    assert (resumed / "checkpoints" / "iter_0000006").is_dir()


@pytest.fixture(scope="module")
def crash_trials(tiny_base, tmp_path_factory):
    """One seed here; tools/bench/crash_trials.py runs more, and Megatron's persistent writer."""
    out = tmp_path_factory.mktemp("crash-trials")
    proc = subprocess.run(
        [sys.executable, "tools/bench/crash_trials.py", "--base", str(tiny_base), "--work",
         str(out), "--seeds", "0", "--json", str(out / "report.json")],
        cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "report.json").read_text())


def test_kill_during_async_saves_resumes_from_an_intact_checkpoint(crash_trials):
    reference = crash_trials["reference"]
    assert reference["code"] == 0
    expected = dict(reference["losses"])
    assert sorted(expected) == list(range(1, 11))
    assert [(t["mode"], t["seed"]) for t in crash_trials["trials"]] == [("fork", 0)]
    for trial in crash_trials["trials"]:
        name = f"{trial['mode']} seed {trial['seed']}"
        killed = trial["killed"]
        assert killed is not None, f"{name}: the run ended before the kill"
        assert trial["code"] == 0, name
        # it resumed from the newest checkpoint that was intact when the run was killed
        resumed = trial["resumed"]
        assert resumed is not None, f"{name}: did not resume ({killed})"
        start = resumed.split("resumed from ")[1].split()[0]
        assert killed["intact"] and Path(start).name == killed["intact"][-1], (name, killed)
        losses = trial["losses"]
        assert [it for it, _ in losses] == list(range(1, 11)), name  # each step once, in order
        for it, loss in losses:
            assert loss == pytest.approx(expected[it], rel=1e-6, abs=1e-7), f"{name}: step {it}"
        assert trial["adapter"] == reference["adapter"], name  # bitwise the same adapter
    (row,) = crash_trials["rows"]  # the benchmark's own verdict agrees
    assert row["resumed_from_newest_intact"] and row["adapter_equal"] and row["each_step_once"]
