"""The preflight's pure parts: nodes of ranks, the two hops of a group, the pairwise schedule,
bandwidth formulas and the table."""

import itertools

import pytest

from megatron_slmoe.parallel import topology
from megatron_slmoe.preflight import sweep
from megatron_slmoe.preflight.report import format_table


def _ranks(n, **fields):
    return [{"rank": r, "host": f"h{r // 2}", **fields} for r in range(n)]


def test_node_ids_prefer_node_size_then_torchrun_then_local_world_then_hosts():
    ranks = [{**r, "group_rank": r["rank"] // 3, "local_world_size": 3} for r in _ranks(6)]
    assert topology.node_ids(ranks, node_size=2) == [0, 0, 1, 1, 2, 2]
    assert topology.node_ids(ranks) == [0, 0, 0, 1, 1, 1]
    no_group = [{**r, "group_rank": None} for r in ranks]
    assert topology.node_ids(no_group) == [0, 0, 0, 1, 1, 1]
    assert topology.node_ids(_ranks(6)) == [0, 0, 1, 1, 2, 2]  # by hostname


def test_split_by_node_gives_the_two_hops():
    node_of = [0, 0, 1, 1, 2, 2]
    intra, inter = topology.split_by_node([0, 1, 2, 3, 4, 5], node_of)
    assert intra == [[0, 1], [2, 3], [4, 5]]
    assert inter == [[0, 2, 4], [1, 3, 5]]
    assert topology.split_by_node([0, 1], node_of) == ([], [])  # already within one node
    assert topology.split_by_node([0, 2], node_of) == ([], [])  # one rank per node: no hops
    assert topology.split_by_node([0, 1, 2], node_of) == ([[0, 1]], [[0, 2]])
    assert topology.scope([0, 1], node_of) == "intra" and topology.scope([1, 2], node_of) == "inter"


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_pair_rounds_cover_every_pair_once_in_disjoint_rounds(n):
    rounds = sweep.pair_rounds(n)
    seen = [p for pairs in rounds for p in pairs]
    assert sorted(seen) == list(itertools.combinations(range(n), 2))
    for pairs in rounds:
        members = [r for p in pairs for r in p]
        assert len(members) == len(set(members))
    assert len(rounds) == n - 1 + n % 2


def test_bus_bandwidth_follows_nccl_tests():
    alg, bus = sweep.bus_bandwidth("all_reduce", 8 * 10**9, 4, 2.0)
    assert alg == pytest.approx(4.0) and bus == pytest.approx(4.0 * 2 * 3 / 4)
    _, bus = sweep.bus_bandwidth("all_to_all", 10**9, 2, 1.0)
    assert bus == pytest.approx(0.5)


def test_rank_ranges():
    assert sweep.rank_ranges([5, 0, 1, 2, 7, 8]) == "0-2, 5, 7-8"
    assert sweep.rank_ranges([3]) == "3"


def test_table_names_scopes_and_the_slowest_pair():
    from megatron_slmoe.preflight.runner import build_report

    ranks = [{"rank": r, "host": f"host{r // 2}", "local_rank": r % 2, "group_rank": r // 2,
              "local_world_size": 2} for r in range(4)]
    node_of = topology.node_ids(ranks)
    per_rank = [{"collectives": [
        {"op": "all_reduce", "kind": "data-parallel", "ranks": [0, 1, 2, 3], "seconds": 0.01 * (r + 1),
         "bytes": 1 << 20},
        {"op": "all_to_all", "kind": "expert-parallel", "ranks": [2 * (r // 2), 2 * (r // 2) + 1],
         "seconds": 0.001, "bytes": 1 << 20}],
        "pairs": []} for r in range(4)]
    per_rank[0]["pairs"] = [{"ranks": [0, 1], "seconds": 0.001}, {"ranks": [0, 2], "seconds": 0.004}]
    per_rank[1]["pairs"] = [{"ranks": [1, 3], "seconds": 0.002}]
    info = {"world_size": 4, "platform": "cpu", "backend": "gloo",
            "layout": {"tp": 1, "pp": 1, "ep": 2, "dp": 4}, "join_seconds": 0.1, "bytes": 1 << 20,
            "p2p_bytes": 1 << 20, "iters": 5, "p2p_iters": 3,
            "p2p_coverage": {"rounds": 3, "rounds_total": 3, "pairs_measured": 3, "pairs_total": 6}}
    report = build_report(per_rank, ranks, node_of, info)
    ar = next(c for c in report["collectives"] if c["op"] == "all_reduce")
    assert ar["time_ms"] == pytest.approx(40.0) and ar["scope"] == "inter"  # slowest member counts
    assert report["summary"]["intra"]["all_to_all"]["groups"] == 2
    assert report["p2p"]["slowest"]["ranks"] == [0, 2]
    text = format_table(report, "x.json")
    assert "slowest pair: rank 0 (node 0, host0) <-> rank 2 (node 1, host1)" in text
    assert "within nodes: all-to-all" in text and "between nodes: all-reduce" in text
    assert "3 of 6 pairs in 3 rounds (capped" in text
