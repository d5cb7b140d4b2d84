"""Two nodes on one machine: two network namespaces joined by a veth pair (.ci/netns.sh), the
launcher run once per node inside each (NNODES=2, NODE_RANK=0/1, MASTER_ADDR=10.77.0.1, gloo on
the veth). A tiny LoRA run trains to completion across the "nodes", with the preflight report
between them; run again with more steps, this time meeting through a c10d rendezvous instead of
a static master, it resumes from its checkpoint, and when the rank on node 1 is killed (kill -9)
torchrun's restart budget restarts both nodes, which resume by themselves and redo the lost step
with the same losses.

Skipped, with the reason, where network namespaces cannot be created (not root, no iproute2)."""

import json
import os
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.helpers.entry_point import NO_ANSWERS_NO_PICTURES, TINY

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def namespaces():
    check = subprocess.run(["bash", ".ci/netns.sh", "check"], cwd=REPO, capture_output=True,
                           text=True, timeout=60)
    if check.returncode != 0:
        pytest.skip(check.stdout.strip() or check.stderr.strip() or "cannot create namespaces")
    tag = f"p{os.getpid() % 10**7}"
    up = subprocess.run(["bash", ".ci/netns.sh", "up", tag], cwd=REPO, capture_output=True,
                        text=True, timeout=60)
    try:
        assert up.returncode == 0, up.stderr
        yield {"ns": [f"slmoe-{tag}-0", f"slmoe-{tag}-1"], "veth": [f"sl{tag}0", f"sl{tag}1"]}
    finally:
        subprocess.run(["bash", ".ci/netns.sh", "down", tag], cwd=REPO, capture_output=True,
                       timeout=60)


def _two_nodes(namespaces, args: list[str], rendezvous: bool = False, timeout: float = 600,
               during=None) -> list[str]:
    """The launcher on both nodes at once; their outputs (stdout + stderr) by node rank.
    ``during()`` runs while they do."""
    procs, logs = [], []
    for rank in (0, 1):
        env = {**os.environ, "NNODES": "2", "NODE_RANK": str(rank), "NPROC_PER_NODE": "1",
               "GLOO_SOCKET_IFNAME": namespaces["veth"][rank]}
        if rendezvous:
            # The host name resolves to 127.0.0.1 in both namespaces: name each node's address,
            # and tell node 0 that it hosts the rendezvous store.
            env.update(RDZV_ENDPOINT="10.77.0.1:29401", RDZV_ID="two-nodes",
                       LOCAL_ADDR=f"10.77.0.{rank + 1}", RDZV_CONF="is_host=1" if rank == 0 else "")
        else:
            env.update(MASTER_ADDR="10.77.0.1", MASTER_PORT="29400")
        logs.append(tempfile.TemporaryFile(mode="w+"))
        procs.append(subprocess.Popen(
            ["ip", "netns", "exec", namespaces["ns"][rank], "bash", "scripts/pretrain_lora.sh", *args],
            cwd=REPO, env=env, stdout=logs[-1], stderr=subprocess.STDOUT, text=True,
            start_new_session=True))
    try:
        if during is not None:
            during()
        for proc in procs:
            proc.wait(timeout=timeout)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    for rank, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"node {rank}:\n{out[-4000:]}"
    return outputs


def test_lora_run_across_two_namespaces_then_resume(namespaces, tiny_base, tmp_path):
    out_dir = tmp_path / "run"
    args = [*TINY, "--base-checkpoint", str(tiny_base), "--save-interval", "2", "--lora-rank", "4",
            *NO_ANSWERS_NO_PICTURES, "--output-dir", str(out_dir)]
    node0, node1 = _two_nodes(namespaces, [*args, "--train-iters", "4"])
    assert "world=2" in node0 and "dp=2" in node0
    assert "[finetune] step 4/4" in node0
    assert (out_dir / "adapter" / "adapter_model.safetensors").is_file()
    for rank in (0, 1):
        assert f"node {rank} of 2" in (out_dir / f"node{rank}.log").read_text()

    # the preflight ran first, between the two namespaces
    report = json.loads((out_dir / "preflight.json").read_text())
    assert report["world_size"] == 2 and [n["ranks"] for n in report["nodes"]] == [[0], [1]]
    assert report["p2p"]["slowest"]["ranks"] == [0, 1]
    assert report["summary"]["inter"]["all_reduce"]["min_busbw_gbps"] > 0
    table = [line for line in node0.splitlines() if line.startswith("[preflight]")]
    assert any("between nodes: all-reduce" in line for line in table)
    assert not any(line.startswith("[preflight]") for line in node1.splitlines())  # rank 0 only
    print("\n" + "\n".join(table))

    # Again, with eight more steps and a rendezvous: both nodes pick up the checkpoint of step 4.
    # Once step 5 is done the rank on node 1 is killed (kill -9), with steps enough left that the
    # kill lands mid-run: torchrun's restart budget restarts both nodes, they resume from the
    # newest checkpoint and redo the steps after it with the same losses.
    metrics = out_dir / "metrics.jsonl"
    seen = {}

    def kill_node1_after_step5():
        deadline = time.time() + 300
        while time.time() < deadline and 5 not in seen:
            for line in metrics.read_text().splitlines():
                record = json.loads(line)
                if "event" not in record:
                    seen[record["iteration"]] = record["loss"]
            time.sleep(0.1)
        assert 5 in seen, "step 5 never came"
        victim = json.loads((out_dir / "attempts" / "1" / "rank_00001.json").read_text())["pid"]
        os.kill(victim, signal.SIGKILL)

    node0, _ = _two_nodes(namespaces, [*args, "--train-iters", "12", "--no-preflight"],
                          rendezvous=True, during=kill_node1_after_step5)
    assert f"resumed from {out_dir}/checkpoints/iter_0000004 at iteration 4" in node0
    assert "[finetune] step 12/12" in node0 and "[preflight]" not in node0
    restart = next((line for line in node0.splitlines() if line.startswith("[restart]")), None)
    assert restart, node0[-4000:]  # rank 0 (node 0) says so, though node 1's worker died
    assert "torchrun restart 1 of 3" in restart and "rank 1 on node" in restart
    assert "ended without a word" in restart
    resumed_at = int(re.search(r"at iteration (\d+)", restart).group(1))
    assert resumed_at in (4, 6), restart  # the newest checkpoint promoted before the kill
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = {r["iteration"]: r["loss"] for r in records if "event" not in r}
    assert [r["iteration"] for r in records if "event" not in r] == list(range(1, 13))
    for it in (it for it in seen if it > resumed_at):  # redone after the restart: as before
        assert steps[it] == pytest.approx(seen[it], rel=1e-6, abs=1e-7), it
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["steps"] == 12
