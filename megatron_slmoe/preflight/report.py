"""The preflight report as a readable table (rank 0 prints it; the JSON has everything)."""

from __future__ import annotations

from megatron_slmoe.preflight.sweep import MIB, rank_ranges

_OPS = {"all_reduce": "all-reduce", "all_to_all": "all-to-all", "p2p": "p2p sweep"}


def format_table(report: dict, path: str | None = None) -> str:
    layout = report["layout"]
    lines = [f"{report['world_size']} ranks on {len(report['nodes'])} nodes joined in "
             f"{report['join_seconds']:.2f} s; backend {report['backend']} ({report['platform']}); "
             f"tp {layout['tp']}, pp {layout['pp']}, ep {layout['ep']}, dp {layout['dp']}"]
    for node in report["nodes"]:
        lines.append(f"  node {node['node']}: {', '.join(node['hosts'])}, ranks {rank_ranges(node['ranks'])}")
    header = (f"{'check':<11} {'groups of':<26} {'scope':<6} {'count':>5} {'ranks':>5} {'MiB':>6} "
              f"{'max ms':>8} {'GB/s min':>9} {'median':>8}")
    lines += [header, "-" * len(header)]
    order = {"all_reduce": 0, "all_to_all": 1, "p2p": 2}
    for row in sorted(report["table"], key=lambda r: (order[r["op"]], r["group"], r["scope"])):
        size = report["p2p"]["bytes"] if row["op"] == "p2p" else report["bytes"]
        lines.append(f"{_OPS[row['op']]:<11} {row['group']:<26} {row['scope']:<6} {row['groups']:>5} "
                     f"{row['ranks_per_group']:>5} {size / MIB:>6.2f} {row['max_time_ms']:>8.2f} "
                     f"{row['min_busbw_gbps']:>9.3f} {row['median_busbw_gbps']:>8.3f}")
    if not report["table"]:
        lines.append("(no group of two or more ranks: nothing to time)")
    lines.append("GB/s: bus bandwidth for collectives (nccl-tests convention), bytes per second "
                 "each way for pairs; 'max ms' per collective / per round trip")
    for where, title in (("intra", "within nodes"), ("inter", "between nodes")):
        s = report["summary"][where]
        parts = [f"{_OPS[op]} {s[op]['min_busbw_gbps']:.3f}" for op in ("all_reduce", "all_to_all")
                 if op in s]
        if "p2p" in s:
            parts.append(f"p2p {s['p2p']['min_gbps']:.3f}")
        lines.append(f"{title}: " + (", ".join(parts) + " GB/s (slowest)" if parts
                                     else "n/a (nothing measured there)"))
    p2p = report["p2p"]
    slow = p2p["slowest"]
    if slow:
        a, b = slow["ranks"]
        lines.append(f"slowest pair: rank {a} (node {slow['nodes'][0]}, {slow['hosts'][0]}) <-> "
                     f"rank {b} (node {slow['nodes'][1]}, {slow['hosts'][1]}): {slow['gbps']:.3f} GB/s, "
                     f"{slow['round_trip_ms']:.2f} ms per round trip of {p2p['bytes'] / MIB:.2f} MiB")
    cover = f"{p2p['pairs_measured']} of {p2p['pairs_total']} pairs in {p2p['rounds']} rounds"
    if p2p["pairs_measured"] < p2p["pairs_total"]:
        cover += " (capped by --p2p-max-rounds / --p2p-time-budget)"
    lines.append(f"pairwise sweep: {cover}; preflight took {report.get('seconds', 0):.1f} s")
    if path:
        lines.append(f"report: {path}")
    return "\n".join(lines)
