#!/usr/bin/env python
"""Kill a fine-tuning run at random moments of its asynchronous checkpoint saves, resume it, and
check that the resume started from an intact checkpoint and reproduced the uninterrupted run.

    python tools/bench/crash_trials.py --json runs/bench/crash_trials.json --seeds 0 1 2 3 4 \
        --persistent [--base DIR]

(``--persistent``: one more trial, with the first seed, on Megatron's persistent writer; without
``--base`` a tiny base checkpoint is made first.) tests/e2e/test_resilience.py runs one seed.

One process imports everything once; each run is a fork of it (one rank, a gloo group of one),
so a trial costs seconds, not an import. For each seed the run saves every step; once a save is
in flight (an ``iter_*.tmp`` exists) and a random 0-40 ms later, the whole process group (the
trainer, its forked or persistent checkpoint writer, the writer's own children) gets SIGKILL.
The same command then resumes and finishes. The table has a row per trial: where the kill fell,
what the resume started from, the largest loss difference against the uninterrupted reference
run of the same invocation, and whether the final adapters are bitwise equal. The JSON holds the
rows and, per trial, the losses by iteration.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch

ITERS = 10
FLAGS = ["--model-config", "tiny", "--seq-length", "64", "--global-batch-size", "4",
         "--micro-batch-size", "2", "--lr", "1e-3", "--lr-warmup-iters", "0", "--eval-iters",
         "1", "--eval-interval", "1000", "--log-interval", "1000", "--lora-rank", "4", "--fp32",
         "--no-tensorboard", "--save-interval", "1", "--keep-last", "2", "--train-iters",
         str(ITERS)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start(argv: list[str], log: Path) -> int:
    """A forked run of the entry point in a process group of its own; its pid."""
    port = _free_port()
    pid = os.fork()
    if pid:
        return pid
    os.setpgid(0, 0)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    code = 1
    try:
        from megatron_slmoe.training.finetune import main

        code = main(argv)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(pid: int, timeout: float = 600) -> int:
    deadline = time.time() + timeout
    while time.time() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.killpg(pid, signal.SIGKILL)
    raise TimeoutError(f"run {pid} did not finish in {timeout} s")


def _losses(out: Path) -> list[list]:
    """[iteration, loss] of every step record of metrics.jsonl, in file order."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [[r["iteration"], r["loss"]] for r in records if "event" not in r]


def _digest(path: Path) -> str:
    """SHA-256 over an adapter's tensors by name (the file's header order varies by process)."""
    from safetensors.torch import load_file

    digest = hashlib.sha256()
    for name, tensor in sorted(load_file(str(path)).items()):
        digest.update(name.encode())
        digest.update(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def run(base: Path, root: Path, seeds: list[int], persistent: bool) -> dict:
    from megatron_slmoe.training.checkpointing import verify

    common = [*FLAGS, "--base-checkpoint", str(base)]
    report: dict = {"trials": []}
    ref = root / "reference"
    code = _wait(_start([*common, "--output-dir", str(ref)], root / "reference.log"))
    report["reference"] = {"code": code, "losses": _losses(ref),
                           "adapter": _digest(ref / "adapter" / "adapter_model.safetensors")}
    modes = [("fork", [], seeds)] + ([("persistent", ["--use-persistent-ckpt-worker"], seeds[:1])]
                                     if persistent else [])
    for mode, extra, mode_seeds in modes:
        for seed in mode_seeds:
            rng = random.Random(seed)
            out, log = root / f"{mode}-{seed}", root / f"{mode}-{seed}.log"
            argv = [*common, *extra, "--output-dir", str(out)]
            skip_saves = rng.randrange(1, ITERS - 3)  # let this many saves go by first
            pid = _start(argv, log)
            ckpts, seen, killed = out / "checkpoints", set(), None
            while killed is None:
                done, _ = os.waitpid(pid, os.WNOHANG)
                if done:
                    break  # finished before the kill: the trial proves nothing, reported as such
                inflight = sorted(p.name for p in ckpts.glob("iter_*.tmp")) if ckpts.is_dir() else []
                seen.update(inflight)
                if inflight and len(seen) > skip_saves:
                    delay = rng.uniform(0, 0.04)
                    time.sleep(delay)
                    os.killpg(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    complete = sorted(p.name for p in ckpts.glob("iter_???????"))
                    killed = {"during": inflight[-1], "delay_s": delay, "complete": complete,
                              "intact": [n for n in complete if verify(str(ckpts / n)) is None]}
                time.sleep(0.002)
            resumed_code = _wait(_start(argv, log))
            resumed = [line for line in log.read_text().splitlines() if "resumed from" in line]
            report["trials"].append({
                "mode": mode, "seed": seed, "killed": killed, "code": resumed_code,
                "resumed": resumed[-1] if resumed else None, "losses": _losses(out),
                "adapter": _digest(out / "adapter" / "adapter_model.safetensors")
                if (out / "adapter").is_dir() else None})
    return report


def make_base(root: Path) -> Path:
    """One full-training step of the tiny model on the shipped corpus, saved as a base."""
    base = root / "base"
    code = _wait(_start([*FLAGS[:FLAGS.index("--save-interval")], "--finetune-mode", "full",
                         "--data-format", "pretrain", "--train-iters", "1", "--output-dir",
                         str(root / "base-run"), "--save-base", str(base)], root / "base.log"))
    if code != 0:
        sys.exit(f"making the base checkpoint failed (exit {code}); see {root / 'base.log'}")
    return base


def rows(report: dict) -> list[dict]:
    """One row per trial, judged against the reference run."""
    expected = dict(report["reference"]["losses"])
    out = []
    for trial in report["trials"]:
        killed, resumed = trial["killed"], trial["resumed"]
        start = resumed.split("resumed from ")[1].split()[0] if resumed else None
        losses = trial["losses"]
        in_order = [it for it, _ in losses] == sorted(expected)
        diff = max((abs(loss - expected[it]) for it, loss in losses if it in expected),
                   default=float("nan"))
        out.append({
            "mode": trial["mode"], "seed": trial["seed"], "exit_code": trial["code"],
            "killed_during": killed["during"] if killed else None,
            "kill_delay_ms": 1000 * killed["delay_s"] if killed else None,
            "resumed_from": Path(start).name if start else None,
            "resumed_from_newest_intact": bool(killed and start and killed["intact"]
                                               and Path(start).name == killed["intact"][-1]),
            "each_step_once": in_order, "max_abs_loss_diff": diff,
            "adapter_equal": trial["adapter"] == report["reference"]["adapter"]})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--json", required=True, help="write the results here")
    parser.add_argument("--base", help="a base checkpoint of the tiny model (made if not given)")
    parser.add_argument("--work", help="keep the runs here (a temporary directory if not given)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--persistent", action="store_true",
                        help="also with Megatron's persistent checkpoint worker")
    args = parser.parse_args()
    if args.base and not os.path.isdir(args.base):
        parser.error(f"--base {args.base} is not a directory")
    import megatron_slmoe.training.finetune  # noqa: F401  (imported once, before the forks)

    with tempfile.TemporaryDirectory(prefix="slmoe-crash-trials-") as temp:
        root = Path(args.work or temp)
        root.mkdir(parents=True, exist_ok=True)
        base = Path(args.base) if args.base else make_base(root)
        report = run(base, root, args.seeds, args.persistent)
    report["rows"] = rows(report)
    print(f"kill -9 during asynchronous saves, {ITERS} steps saving every step, against the "
          f"uninterrupted run (reference exit {report['reference']['code']})")
    print(f"{'mode':<12}{'seed':>5}{'killed during':>16}{'+ms':>6}{'resumed from':>16}"
          f"{'newest intact':>15}{'max |dloss|':>13}{'adapter equal':>15}")
    for r in report["rows"]:
        print(f"{r['mode']:<12}{r['seed']:>5}{r['killed_during']!s:>16}"
              f"{(r['kill_delay_ms'] or 0):>6.0f}{r['resumed_from']!s:>16}"
              f"{r['resumed_from_newest_intact']!s:>15}{r['max_abs_loss_diff']:>13.2e}"
              f"{r['adapter_equal']!s:>15}")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    from megatron_slmoe.utils.atomic import write_json_atomic

    write_json_atomic(args.json, {"benchmark": "crash_trials", "settings": vars(args), **report})


if __name__ == "__main__":
    main()
