"""A real SLURM (munged, slurmctld and two slurmd on this machine, .ci/start_slurm.sh) runs
scripts/slurm/pretrain_lora_cpu.sbatch as a two-node job of the tiny model: both nodes train
together, the job is signalled mid-run (USR1, as before a time limit), requeues itself and
resumes from its checkpoint, then finishes and writes the adapter. (With --no-preflight: the
preflight between two nodes is tests/e2e/test_two_nodes.py's; here it would run again at each
start of the job and prove nothing more.)

Uses the cluster named by SLMOE_SLURM_DIR when it is up (e.g. started by .ci/run), else starts a
private one (its own directory and ports) and stops it afterwards. Skipped, with the reason, where
SLURM cannot be started (not root, no packages)."""

import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = ["--model-config", "tiny", "--seq-length", "64", "--global-batch-size", "8",
        "--micro-batch-size", "2", "--eval-iters", "1", "--eval-interval", "1000", "--fp32",
        "--no-tensorboard", "--log-interval", "1", "--lr-warmup-iters", "0"]


def _free_port_block(count: int = 3) -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count > 65535:
            continue
        try:
            for port in range(base, base + count):
                with socket.socket() as t:
                    t.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no block of free ports")


def _slurm(cmd, env, **kw):
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, **kw)


@pytest.fixture(scope="module")
def slurm_env():
    if os.geteuid() != 0:
        pytest.skip("SLURM test needs root (it starts munged, slurmctld and two slurmd)")
    shared = os.environ.get("SLMOE_SLURM_DIR")
    if shared:
        env = {**os.environ, "SLURM_CONF": os.path.join(shared, "slurm.conf")}
        if _slurm(["bash", ".ci/start_slurm.sh", "status"], env, cwd=REPO).returncode == 0:
            yield env
            return
    directory = tempfile.mkdtemp(prefix="slmoe-slurm-", dir="/tmp")  # short: munge socket path
    env = {**os.environ, "SLMOE_SLURM_DIR": directory, "SLMOE_SLURM_PORT": str(_free_port_block()),
           "SLURM_CONF": os.path.join(directory, "slurm.conf")}
    start = subprocess.run(["bash", ".ci/start_slurm.sh", "start"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=900)
    try:
        if start.returncode != 0:
            reason = (start.stderr.strip().splitlines() or ["no message"])[-1]
            pytest.skip(f"SLURM could not be started: {reason}")
        yield env
    finally:
        subprocess.run(["bash", ".ci/start_slurm.sh", "stop"], cwd=REPO, env=env,
                       capture_output=True, timeout=120)
        shutil.rmtree(directory, ignore_errors=True)


def _job_field(env, job_id, name):
    out = _slurm(["scontrol", "show", "job", job_id], env).stdout
    match = re.search(rf"\b{name}=(\S+)", out)
    return match.group(1) if match else None


@pytest.fixture(scope="module")
def requeued_job(slurm_env, tiny_base, tmp_path_factory):
    """Submit a 6-step LoRA job on both nodes, send it USR1 once its first checkpoint is saved,
    and wait until the requeued job has finished."""
    work = tmp_path_factory.mktemp("slurm-job")
    out_dir, log = work / "run", work / "job.out"
    env = {**slurm_env, "NPROC_PER_NODE": "1", "OUTPUT_DIR": str(out_dir)}
    started = time.time()
    submit = _slurm(["sbatch", "--parsable", "--job-name", f"slmoe-ci-{os.getpid()}",
                     "--output", str(log), "scripts/slurm/pretrain_lora_cpu.sbatch",
                     "--no-preflight", *TINY, "--base-checkpoint", str(tiny_base),
                     "--train-iters", "6", "--save-interval", "2", "--lora-rank", "4"], env,
                    cwd=REPO)
    assert submit.returncode == 0, submit.stderr
    job_id = submit.stdout.strip().split(";")[0]
    try:
        deadline = time.time() + 300
        while not (out_dir / "checkpoints" / "latest").exists():
            assert time.time() < deadline, log.read_text()[-3000:] if log.exists() else "no output"
            assert _job_field(env, job_id, "JobState") in ("PENDING", "RUNNING", "CONFIGURING"), \
                log.read_text()[-3000:] if log.exists() else "job ended without output"
            time.sleep(0.5)
        signalled = _slurm(["scancel", "--batch", "--signal=USR1", job_id], env)
        assert signalled.returncode == 0, signalled.stderr
        while _job_field(env, job_id, "JobState") not in ("COMPLETED", "FAILED", "CANCELLED",
                                                          "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            assert time.time() < deadline, log.read_text()[-3000:]
            time.sleep(1)
    except BaseException:
        _slurm(["scancel", job_id], env)
        raise
    return {"env": env, "id": job_id, "out_dir": out_dir, "log": log.read_text(),
            "seconds": time.time() - started}


def test_both_nodes_trained_together_and_wrote_the_adapter(requeued_job):
    job, log = requeued_job, requeued_job["log"]
    env, job_id = job["env"], job["id"]
    assert _job_field(env, job_id, "JobState") == "COMPLETED", log[-4000:]
    assert _job_field(env, job_id, "ExitCode") == "0:0"
    assert _job_field(env, job_id, "NumNodes") == "2"
    out_dir = job["out_dir"]
    for rank in (0, 1):  # one launcher per node, each with its own log
        node_log = (out_dir / f"node{rank}.log").read_text()
        assert f"node {rank} of 2" in node_log
    assert "world=2" in log and "dp=2" in log
    assert "master 127.0.0.1:" in log  # the first node's address, from SLURM
    assert (out_dir / "adapter" / "adapter_model.safetensors").is_file()
    assert (out_dir / "summary.json").is_file()
    print(f"\n[slurm test] job {job_id}: {job['seconds']:.0f} s from submission to completion")


def test_requeued_job_resumed_from_its_checkpoint(requeued_job):
    job, log = requeued_job, requeued_job["log"]
    assert _job_field(job["env"], job["id"], "Restarts") == "1"
    assert f"USR1: requeueing job {job['id']}" in log
    assert "(restart 1)" in log  # the batch script ran again (--open-mode=append keeps both)
    resumed = re.search(r"\[finetune\] resumed from \S+/checkpoints/iter_(\d+) at iteration (\d+)", log)
    assert resumed, log[-4000:]
    assert int(resumed.group(2)) >= 2
    assert "[finetune] step 6/6" in log
