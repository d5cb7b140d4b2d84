"""The preflight on real gloo ranks: 4 ranks as 2 logical nodes report collectives within and
between nodes and a slowest pair; ranks that never come are named in one line."""

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.ranks import free_port

REPO = Path(__file__).resolve().parents[2]


def test_four_ranks_on_two_logical_nodes(tmp_path):
    report_path = tmp_path / "preflight.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
         "-m", "megatron_slmoe.preflight", "--node-size", "2", "--size-mb", "0.25",
         "--p2p-size-mb", "0.25", "--report", str(report_path), "--",
         "--expert-model-parallel-size", "2"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["world_size"] == 4 and [n["ranks"] for n in report["nodes"]] == [[0, 1], [2, 3]]
    assert report["layout"] == {"tp": 1, "pp": 1, "ep": 2, "dp": 4}
    # DP (all 4 ranks) spans both nodes and is also timed as its two hops; EP pairs are node-local.
    groups = {(c["op"], c["group"], c["scope"], tuple(c["ranks"])) for c in report["collectives"]}
    assert ("all_reduce", "data-parallel", "inter", (0, 1, 2, 3)) in groups
    assert ("all_reduce", "data-parallel within nodes", "intra", (0, 1)) in groups
    assert ("all_reduce", "data-parallel across nodes", "inter", (1, 3)) in groups
    assert ("all_to_all", "expert-parallel", "intra", (2, 3)) in groups
    for where in ("intra", "inter"):
        assert report["summary"][where]["all_reduce"]["min_busbw_gbps"] > 0
        assert report["summary"][where]["p2p"]["min_gbps"] > 0
    p2p = report["p2p"]
    assert p2p["pairs_measured"] == p2p["pairs_total"] == 6
    assert len(p2p["pairs"]) == 6 and p2p["slowest"] in p2p["pairs"]
    # the table, once, from rank 0
    out = proc.stdout
    assert out.count("[preflight] 4 ranks on 2 nodes joined") == 1
    assert "[preflight] within nodes: all-reduce" in out and "[preflight] between nodes: all-reduce" in out
    assert "[preflight] slowest pair: rank" in out and f"report: {report_path}" in out


def test_missing_rank_is_named_in_one_line(tmp_path):
    port = free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "3",
           "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "megatron_slmoe.preflight", "--timeout", "3",
                               "--report", str(tmp_path / "r.json")], cwd=REPO,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [1, 1]
    errors = [line for _, err in outs for line in err.splitlines() if line.startswith("preflight:")]
    assert len(errors) == 1, outs  # said once, by the lowest rank that joined
    assert errors[0].startswith("preflight: error: 1 of 3 ranks did not join within 3 s: "
                                "rank 2 (node 1, no rank of that node joined). Joined: ")
    assert errors[0].endswith(": ranks 0-1")
    assert not (tmp_path / "r.json").exists()
