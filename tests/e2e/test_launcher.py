"""scripts/pretrain_lora.sh as a multi-node launcher, checked with --dry-run (nothing starts):
torchrun's layout from NNODES / NODE_RANK / MASTER_ADDR / MASTER_PORT / NPROC_PER_NODE or a c10d
rendezvous, settings from the environment, the network profile checked before anything runs."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.helpers.sysfs import ROCE_GIDS, fake_sysfs
from tests.helpers.entry_point import stand_in_base

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--train-iters", "15", "--lr-warmup-iters", "0"]


@pytest.fixture
def sandbox(tmp_path):
    """A fake torchrun (and nvidia-smi when asked) that would leave a mark if ever started."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    marker = tmp_path / "started"
    fake = bin_dir / "torchrun"
    fake.write_text(f"#!/bin/sh\ntouch {marker}\n")
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "HCCL_", "RDZV_"))}
    for name in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "NPROC_PER_NODE", "LOCAL_ADDR",
                 "NETWORK_PROFILE", "CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES", "TP", "EP",
                 "OUTPUT_DIR", "DISTRIBUTED_TIMEOUT_MINUTES", "SLMOE_PREFLIGHT", "MAX_RESTARTS",
                 "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"):
        env.pop(name, None)
    # never let a build-stamp mismatch reinstall a different torch because of the fake GPU tools
    env.update(TORCHRUN=str(fake), SLMOE_TORCH_SPEC=f"torch=={torch.__version__}")
    base = stand_in_base(tmp_path / "base")  # LoRA needs a named base; a dry run loads none
    return {"env": env, "bin": bin_dir, "marker": marker, "tmp": tmp_path,
            "small": [*SMALL, "--base-checkpoint", str(base)]}


def _launch(sandbox, args, **env):
    proc = subprocess.run(["bash", "scripts/pretrain_lora.sh", *args], cwd=REPO,
                          env={**sandbox["env"], **env}, capture_output=True, text=True, timeout=300)
    assert not sandbox["marker"].exists(), "torchrun was started"
    return proc


def _commands(stdout):
    lines = stdout.splitlines()
    return {lines[i - 1].split()[1]: lines[i] for i, line in enumerate(lines)
            if i and lines[i - 1].startswith(("# preflight", "# training"))}


def test_static_master_layout_and_settings(sandbox):
    out_dir = sandbox["tmp"] / "run"
    proc = _launch(sandbox, ["--dry-run", *sandbox["small"], "--output-dir", str(out_dir)],
                   NNODES="2", NODE_RANK="1", MASTER_ADDR="10.1.2.3", MASTER_PORT="23456",
                   NPROC_PER_NODE="4", TP="2", DISTRIBUTED_TIMEOUT_MINUTES="7")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for line in ("NNODES=2", "NODE_RANK=1", "MASTER_ADDR=10.1.2.3", "MASTER_PORT=23456",
                 "NPROC_PER_NODE=4", "DISTRIBUTED_TIMEOUT_MINUTES=7"):
        assert line in lines
    commands = _commands(proc.stdout)
    layout = ("--nproc-per-node 4 --nnodes 2 --node-rank 1 --master-addr 10.1.2.3 "
              "--master-port 23456")
    train = commands["training"]
    assert train.startswith(f"{sandbox['env']['TORCHRUN']} {layout} --max-restarts 3 "
                            f"-m megatron_slmoe.training.finetune ")
    assert "--tensor-model-parallel-size 2" in train and "--distributed-timeout-minutes 7" in train
    assert train.endswith(f"{' '.join(sandbox['small'])} --output-dir {out_dir}")
    pre = commands["preflight"]
    assert f"{layout} -m megatron_slmoe.preflight --report {out_dir}/preflight.json -- " in pre
    assert f"# log: {out_dir}/node1.log" in lines
    assert not out_dir.exists()


def test_rendezvous_layout(sandbox):
    proc = _launch(sandbox, ["--dry-run", *sandbox["small"], "--distributed-timeout-minutes", "9"],
                   NNODES="2", NPROC_PER_NODE="2", RDZV_ENDPOINT="head-node:29400",
                   RDZV_ID="job42", RDZV_CONF="is_host=1", LOCAL_ADDR="10.0.0.5",
                   DISTRIBUTED_TIMEOUT_MINUTES="7")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert {"RDZV_BACKEND=c10d", "RDZV_ENDPOINT=head-node:29400", "RDZV_ID=job42",
            "RDZV_CONF=is_host=1", "LOCAL_ADDR=10.0.0.5"} <= set(lines)
    commands = _commands(proc.stdout)
    rdzv = ("--nproc-per-node 2 --nnodes 2 --rdzv-backend c10d --rdzv-endpoint head-node:29400 "
            "--rdzv-conf is_host=1 --local-addr 10.0.0.5")
    assert (f"{rdzv} --max-restarts 3 --rdzv-id job42 -m megatron_slmoe.training.finetune"
            in commands["training"])
    assert f"{rdzv} --rdzv-id job42-preflight -m megatron_slmoe.preflight" in commands["preflight"]
    for text in commands.values():
        assert "--node-rank" not in text and "--master-addr" not in text
    # the environment's timeout is a default: the flag on the command line comes later and wins
    train = commands["training"]
    assert train.index("--distributed-timeout-minutes 7") < train.index("--distributed-timeout-minutes 9")


def test_processes_per_node_from_visible_devices(sandbox):
    nvidia = sandbox["bin"] / "nvidia-smi"
    nvidia.write_text("#!/bin/sh\nfor i in 0 1 2; do echo \"GPU $i: NVIDIA H100 (UUID: GPU-$i)\"; done\n")
    nvidia.chmod(0o755)
    path = f"{sandbox['bin']}:{sandbox['env']['PATH']}"
    cases = [({"PATH": path}, 3), ({"PATH": path, "CUDA_VISIBLE_DEVICES": "0,1"}, 2),
             ({"ASCEND_RT_VISIBLE_DEVICES": "0,1,2,3"}, 4), ({}, 2)]
    for env, expected in cases:
        proc = _launch(sandbox, ["--dry-run", "--no-preflight", *sandbox["small"],
                                 "--global-batch-size", "48",
                                 "--micro-batch-size", "1"], **env)
        assert proc.returncode == 0, proc.stderr
        assert f"NPROC_PER_NODE={expected}" in proc.stdout.splitlines(), (env, proc.stdout)
        assert "# preflight" not in proc.stdout
        assert f"--nproc-per-node {expected} --nnodes 1 --standalone" in _commands(proc.stdout)["training"]


def test_network_profile_checked_before_launch(sandbox):
    sysfs = fake_sysfs(sandbox["tmp"] / "sys", hcas={"mlx5_0": {1: ("4: ACTIVE", "Ethernet", ROCE_GIDS)}})
    good = {"NETWORK_PROFILE": "roce", "SLMOE_SYSFS_ROOT": str(sysfs)}
    proc = _launch(sandbox, ["--dry-run", *sandbox["small"]], **good)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "[netcheck] profile roce: ok" in lines
    # the profile's documented defaults are exported, and an explicit value wins
    assert {"NCCL_IB_GID_INDEX=3", "NCCL_IB_HCA=mlx5", "NCCL_SOCKET_IFNAME=eth0",
            "NCCL_IB_TC=106", "NETWORK_PROFILE=roce"} <= set(lines)

    # a RoCE v1 GID: one line, exit 2, no command printed, nothing started (even without --dry-run)
    for args in (["--dry-run", *sandbox["small"]], sandbox["small"]):
        proc = _launch(sandbox, args, **good, NCCL_IB_GID_INDEX="2")
        assert proc.returncode == 2
        assert proc.stderr.splitlines() == [
            f"netcheck: NCCL_IB_GID_INDEX=2: GID 2 of mlx5_0 port 1 is 'IB/RoCE v1', not 'RoCE v2' "
            f"({sysfs}/class/infiniband/mlx5_0/ports/1/gid_attrs/types/2; RoCE v2 GIDs here: 1, 3)"]
        assert "torchrun" not in proc.stdout

    proc = _launch(sandbox, ["--dry-run", *sandbox["small"]], NETWORK_PROFILE="opa")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["error: NETWORK_PROFILE=opa is not one of ib, roce, hccl"]


@pytest.mark.parametrize("env, message", [
    ({"NNODES": "2", "MASTER_ADDR": "10.0.0.1"},
     "error: NODE_RANK is not set (needed with NNODES=2 and a static master; or set RDZV_ENDPOINT)"),
    ({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "10.0.0.1"},
     "error: NODE_RANK=2 must be below NNODES=2"),
    ({"NPROC_PER_NODE": "two"}, "error: NPROC_PER_NODE=two must be an integer >= 1"),
])
def test_bad_layout_is_one_line(sandbox, env, message):
    proc = _launch(sandbox, ["--dry-run", *sandbox["small"]], **env)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [message]


def test_restart_budget_and_fresh_store_for_restarts(sandbox):
    proc = _launch(sandbox, ["--dry-run", "--no-preflight", *sandbox["small"]], MAX_RESTARTS="5")
    assert proc.returncode == 0, proc.stderr
    assert {"MAX_RESTARTS=5", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"} <= set(proc.stdout.splitlines())
    assert " --max-restarts 5 -m megatron_slmoe.training.finetune " in _commands(proc.stdout)["training"]


def test_help_is_printed_once_and_creates_nothing(sandbox):
    before = sorted(p.name for p in REPO.iterdir()), (REPO / "runs" / "logs").exists()
    proc = _launch(sandbox, ["--help"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("usage: megatron_slmoe.training.finetune") == 1
    assert "MAX_RESTARTS" in proc.stdout and "--heartbeat-timeout" in proc.stdout
    assert (sorted(p.name for p in REPO.iterdir()), (REPO / "runs" / "logs").exists()) == before


def test_the_settings_comments_name_real_lora_targets():
    """The launcher's comment on LORA_TARGET_MODULES shows the default targets, by their names."""
    from megatron_slmoe.lora.config import DEFAULT_LORA_TARGETS
    from megatron_slmoe.lora.targets import TARGETS

    line = next(line for line in (REPO / "scripts" / "pretrain_lora.sh").read_text().splitlines()
                if "--lora-target-modules" in line and "LORA_TARGET_MODULES" in line)
    shown = line.rsplit("# [", 1)[1].rstrip("]").split()
    assert shown == list(DEFAULT_LORA_TARGETS) and set(shown) <= set(TARGETS)


def test_a_dry_run_of_the_demo_on_a_fresh_checkout_prints_both_steps(sandbox):
    """No base yet: the LoRA step's checks wait for the base the first step makes (they failed
    with '--base-checkpoint runs/demo/base: no such file or directory'); nothing is written."""
    demo = sandbox["tmp"] / "demo"
    proc = _launch(sandbox, ["--dry-run"], SLMOE_DEMO_DIR=str(demo))
    assert proc.returncode == 0, proc.stderr[-2000:]
    trainings = [line for line in proc.stdout.splitlines()
                 if "-m megatron_slmoe.training.finetune" in line]
    assert len(trainings) == 2
    assert "--save-base" in trainings[0] and f"--base-checkpoint {demo}/base" in trainings[1]
    assert "checked when it starts" in proc.stdout
    assert not demo.exists()


def test_the_multimodal_demo_refuses_a_folder_of_another_task_version(sandbox):
    """A demo folder whose data an earlier version of the shapes task made (no task_version,
    as before versions were written), or whose data is gone beside its base: one line naming
    the folder to remove, exit 2, nothing started or written."""
    from megatron_slmoe.data import shapes

    demo = sandbox["tmp"] / "demo-image-text"
    shapes.generate(str(demo / "data"), captions=4, vqa_train=4, vqa_eval=4)
    (demo / "data" / "task_version").unlink()
    proc = _launch(sandbox, ["--task", "image-text", "--dry-run"], SLMOE_DEMO_DIR=str(demo))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: {demo} was made by an earlier version of the shapes task: remove it to make "
        f"it again"]
    shutil.rmtree(demo / "data")
    (demo / "base").mkdir()
    proc = _launch(sandbox, ["--task", "image-text", "--dry-run"], SLMOE_DEMO_DIR=str(demo))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: {demo}/base was trained on data that is gone: remove {demo} to make both again"]
    assert sorted(p.name for p in demo.iterdir()) == ["base"]


def _launch_for_real(args, tmp_path, **env):
    """scripts/pretrain_lora.sh with torchrun and its default restart budget, 2 processes."""
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("NCCL_", "HCCL_", "RDZV_", "MASTER_", "NODE_RANK", "NNODES",
                                  "NPROC_PER_NODE", "NETWORK_PROFILE", "MAX_RESTARTS", "TORCHRUN",
                                  "SLMOE_END_REPORT"))}
    return subprocess.run(["bash", "scripts/pretrain_lora.sh", "--no-preflight", *args], cwd=REPO,
                          env={**clean, "NPROC_PER_NODE": "2", "TMPDIR": str(tmp_path), **env},
                          capture_output=True, text=True, timeout=300)


def test_a_failure_that_repeats_ends_the_job_in_one_line(tiny_base, tmp_path):
    """A loss gone NaN mid-run (every rank meets it at the same step; a restart would replay it)
    under the launcher and torchrun's restart budget: the job ends at once, with one line on the
    terminal and exit code 2, no restart, and each rank's traceback in the attempt log, not on
    the terminal (torchrun's and the ranks' tracebacks came first, and the budget was spent)."""
    run = tmp_path / "run"
    proc = _launch_for_real([*SMALL, "--model-config", "tiny", "--seq-length", "64",
                             "--global-batch-size", "4", "--micro-batch-size", "2", "--fp32",
                             "--eval-iters", "1", "--no-tensorboard", "--base-checkpoint",
                             str(tiny_base), "--lr", "1e30", "--output-dir", str(run)], tmp_path)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: step 2: the training loss is "), lines
    assert "Traceback" not in proc.stdout and "Error" not in proc.stdout, proc.stdout[-3000:]
    assert [p.name for p in (run / "attempts").iterdir() if p.name.isdigit()] == ["0"]
    # The rank that fails first keeps its traceback; one that torchrun stops at SIGTERM may have
    # nothing to keep (or only opened its log), never a traceback of another error.
    logged = {p.name: p.read_text() for p in (run / "attempts").glob("rank_*.log")}
    assert set(logged) <= {"rank_00000.log", "rank_00001.log"}, logged
    kept = [text for text in logged.values() if text]
    assert kept and all("Traceback" in t and "NonFiniteError" in t for t in kept), logged
    assert "Traceback" in (run / "node0.log").read_text()  # torchrun's own, kept in the log
    assert not list(tmp_path.glob("slmoe-end.*"))
