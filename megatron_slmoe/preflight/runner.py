"""The preflight's distributed part: join, groups, timed collectives, the pairwise sweep."""

from __future__ import annotations

import json
import math
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron_slmoe.moe.config import EXPERT_TENSOR_PARALLEL_SIZE
from megatron_slmoe.parallel import topology
from megatron_slmoe.platform import apply_adaptor
from megatron_slmoe.preflight import sweep
from megatron_slmoe.preflight.sweep import MIB


class PreflightError(RuntimeError):
    """A check failed; the message is one line, already naming ranks and hosts."""


@dataclass
class PreflightOptions:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    size_mb: Optional[float] = None  # collectives' message; default by platform
    iters: int = 5
    warmup: int = 1
    p2p_size_mb: Optional[float] = None
    p2p_iters: int = 3
    p2p_time_budget: float = 10.0
    p2p_max_rounds: int = 64
    node_size: Optional[int] = None
    timeout: float = 60.0


def _env_int(name: str) -> Optional[int]:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None


class _Preflight:
    def __init__(self, options: PreflightOptions, platform) -> None:
        self.o, self.platform = options, platform
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.host = socket.gethostname()
        self.timeout = timedelta(seconds=options.timeout)
        accelerator = platform.name != "cpu"
        self.size = int((options.size_mb or (64 if accelerator else 1)) * MIB)
        self.p2p_size = int((options.p2p_size_mb or (16 if accelerator else 1)) * MIB)
        self.device = platform.device(self.local_rank)

    def _identity(self) -> dict:
        """What the others learn about this rank (torchrun's GROUP_RANK is its node)."""
        return {"rank": self.rank, "host": self.host, "local_rank": self.local_rank,
                "group_rank": _env_int("GROUP_RANK"), "local_world_size": _env_int("LOCAL_WORLD_SIZE")}

    # -- 1. join ---------------------------------------------------------------------------------

    def _store(self):
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = int(os.environ.get("MASTER_PORT", "29500"))
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        try:
            # Under torchrun the agent of node 0 hosts the store; otherwise rank 0 does. Either
            # way nobody waits for all clients here: the join below names who is missing.
            store = dist.TCPStore(addr, port, None, not agent and self.rank == 0,
                                  timeout=self.timeout, wait_for_workers=False, multi_tenant=True)
        except Exception as err:  # noqa: BLE001  (connection refused, timeout, DNS)
            raise PreflightError(
                f"rank {self.rank} on {self.host} cannot reach the rendezvous store at "
                f"{addr}:{port} within {self.o.timeout:g} s ({_first_line(err)})") from None
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return dist.PrefixStore(f"slmoe_preflight/{restart}/", store)

    def join(self) -> tuple[Any, float]:
        start = time.perf_counter()
        store = self._store()
        store.set(f"joined/{self.rank}", json.dumps(self._identity()))
        store.add("count", 1)
        deadline = start + self.o.timeout
        while store.add("count", 0) < self.world:
            if time.perf_counter() > deadline:
                raise PreflightError(self._missing_message(store))
            time.sleep(0.05)
        return store, time.perf_counter() - start

    def _missing_message(self, store) -> str:
        joined = {}
        for r in range(self.world):
            if store.check([f"joined/{r}"]):
                joined[r] = json.loads(store.get(f"joined/{r}"))
        missing = [r for r in range(self.world) if r not in joined]
        if joined and self.rank != min(joined):
            return ""  # the lowest rank that joined says it, once
        per_node = joined[self.rank].get("local_world_size") or 1
        nodes: dict[int, list[int]] = {}
        for r in missing:
            nodes.setdefault(r // per_node, []).append(r)
        parts = []
        for node, ranks in sorted(nodes.items()):
            mates = {joined[r]["host"] for r in joined if r // per_node == node}
            where = f"node {node}" + (f", host {', '.join(sorted(mates))}" if mates else
                                      ", no rank of that node joined")
            parts.append(f"rank{'s' if len(ranks) > 1 else ''} {sweep.rank_ranges(ranks)} ({where})")
        hosts: dict[str, list[int]] = {}
        for r, info in joined.items():
            hosts.setdefault(info["host"], []).append(r)
        present = "; ".join(f"{h}: rank{'s' if len(rs) > 1 else ''} {sweep.rank_ranges(rs)}"
                            for h, rs in sorted(hosts.items()))
        return (f"{len(missing)} of {self.world} ranks did not join within {self.o.timeout:g} s: "
                f"{'; '.join(parts)}. Joined: {present}")

    # -- 2. groups -------------------------------------------------------------------------------

    def init_groups(self, store) -> None:
        from megatron.core import parallel_state

        self.platform.set_device(self.local_rank)
        self._step("forming the process group", lambda: dist.init_process_group(
            self.platform.backend, store=dist.PrefixStore("pg/", store), rank=self.rank,
            world_size=self.world, timeout=self.timeout))
        self.ranks = [None] * self.world
        dist.all_gather_object(self.ranks, self._identity())
        self.node_of = topology.node_ids(self.ranks, self.o.node_size)
        self._step("building Megatron's parallel groups", lambda: parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=self.o.tp, pipeline_model_parallel_size=self.o.pp,
            expert_model_parallel_size=self.o.ep,
            expert_tensor_parallel_size=EXPERT_TENSOR_PARALLEL_SIZE,
            distributed_timeout_minutes=max(1, math.ceil(self.o.timeout / 60))))
        mine = {"data-parallel": parallel_state.get_data_parallel_group(),
                "expert-parallel": parallel_state.get_expert_model_parallel_group()}
        self.own_groups = mine
        gathered = [None] * self.world
        dist.all_gather_object(gathered, {k: dist.get_process_group_ranks(g) for k, g in mine.items()})
        self.all_groups = {k: sorted({tuple(g[k]) for g in gathered}) for k in mine}

    def _step(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except PreflightError:
            raise
        except Exception as err:  # noqa: BLE001
            raise PreflightError(f"rank {self.rank} on {self.host}: {what} failed: "
                                 f"{_first_line(err)}") from None

    # -- 3. collectives --------------------------------------------------------------------------

    def _phases(self) -> list[tuple[str, str, list[tuple[int, ...]], Optional[Any]]]:
        """(op, group kind, every group's ranks, this rank's handle or None to create)."""
        phases = []
        for op, kind in (("all_reduce", "data-parallel"), ("all_to_all", "expert-parallel")):
            groups = [g for g in self.all_groups[kind] if len(g) > 1]
            if groups:
                phases.append((op, kind, groups, self.own_groups[kind]))
            intra, inter = [], []
            for g in groups:
                a, b = topology.split_by_node(g, self.node_of)
                intra += a
                inter += b
            if intra:
                phases.append((op, f"{kind} within nodes", [tuple(g) for g in intra], None))
            if inter:
                phases.append((op, f"{kind} across nodes", [tuple(g) for g in inter], None))
        return phases

    def collectives(self) -> list[dict]:
        results = []
        for op, kind, groups, handle in self._phases():
            own = next((g for g in groups if self.rank in g), None)
            if handle is None:  # every rank creates every group, in the same order
                for g in groups:
                    created = self._step(f"creating the {kind} group {list(g)}", lambda g=g: dist.new_group(
                        list(g), timeout=self.timeout))
                    if g == own:
                        handle = created
            if own is None:
                continue
            seconds = self._step(
                f"{op.replace('_', '-')} over the {kind} group {list(own)}",
                lambda: self._time_collective(op, handle, own))
            results.append({"op": op, "kind": kind, "ranks": list(own), "seconds": seconds,
                            "bytes": self._numel(len(own)) * 4})
        return results

    def _numel(self, n: int) -> int:
        """float32 elements of a collective's message: about --size-mb, a multiple of n."""
        return max(n, self.size // 4 // n * n)

    def _time_collective(self, op: str, group, ranks: tuple[int, ...]) -> float:
        n = len(ranks)
        x = torch.full((self._numel(n),), float(self.rank + 1), dtype=torch.float32, device=self.device)
        out = torch.empty_like(x)
        if op == "all_reduce":
            dist.all_reduce(x, group=group)
            expected = float(sum(r + 1 for r in ranks))
            ok = bool(torch.all(x == expected))
            x.zero_()
            fn = lambda: dist.all_reduce(x, group=group)  # noqa: E731
        else:
            dist.all_to_all_single(out, x, group=group)
            got = out.view(n, -1)[:, 0].tolist()
            ok = got == [float(r + 1) for r in ranks]
            fn = lambda: dist.all_to_all_single(out, x, group=group)  # noqa: E731
        if not ok:
            raise PreflightError(f"rank {self.rank} on {self.host}: {op.replace('_', '-')} over "
                                 f"{list(ranks)} returned wrong values (corrupted transfer)")
        for _ in range(self.o.warmup):
            fn()
        self.platform.synchronize()
        start = time.perf_counter()
        for _ in range(self.o.iters):
            fn()
        self.platform.synchronize()
        return (time.perf_counter() - start) / self.o.iters

    # -- 4. pairwise sweep -----------------------------------------------------------------------

    def p2p_sweep(self) -> tuple[list[dict], dict]:
        rounds = sweep.pair_rounds(self.world)
        buf = torch.zeros(self.p2p_size // 4, dtype=torch.float32, device=self.device)
        flag = torch.zeros(1, dtype=torch.int32, device=self.device)
        results, done, start = [], 0, time.perf_counter()
        for pairs in rounds[: self.o.p2p_max_rounds]:
            if self.rank == 0:
                flag.fill_(int(time.perf_counter() - start < self.o.p2p_time_budget))
            dist.broadcast(flag, src=0)
            if not int(flag.item()):
                break
            done += 1
            partner = next((b if a == self.rank else a for a, b in pairs if self.rank in (a, b)), None)
            if partner is None:
                continue
            seconds = self._step(f"point-to-point with rank {partner}",
                                 lambda: self._ping_pong(buf, partner))
            if self.rank < partner:
                results.append({"ranks": [self.rank, partner], "seconds": seconds})
        total = self.world * (self.world - 1) // 2
        measured = sum(len(p) for p in rounds[:done])
        return results, {"rounds": done, "rounds_total": len(rounds), "pairs_measured": measured,
                         "pairs_total": total}

    def _ping_pong(self, buf: torch.Tensor, partner: int) -> float:
        first = self.rank < partner

        def once():
            if first:
                dist.send(buf, partner)
                dist.recv(buf, partner)
            else:
                dist.recv(buf, partner)
                dist.send(buf, partner)

        once()  # warm-up (NCCL/HCCL build the pair's connection here)
        self.platform.synchronize()
        start = time.perf_counter()
        for _ in range(self.o.p2p_iters):
            once()
        self.platform.synchronize()
        return (time.perf_counter() - start) / self.o.p2p_iters

    # -- 5. report -------------------------------------------------------------------------------

    def gather(self, collectives: list[dict], pairs: list[dict]) -> Optional[list[dict]]:
        gathered = [None] * self.world if self.rank == 0 else None
        dist.gather_object({"collectives": collectives, "pairs": pairs}, gathered, dst=0)
        return gathered


def build_report(per_rank: list[dict], ranks: list[dict], node_of: list[int], info: dict) -> dict:
    """Rank 0: fold the per-rank timings into per-group and per-scope figures."""
    groups: dict[tuple, dict] = {}
    for record in per_rank:
        for c in record["collectives"]:
            key = (c["op"], c["kind"], tuple(c["ranks"]))
            entry = groups.setdefault(key, {"op": c["op"], "kind": c["kind"], "ranks": c["ranks"],
                                            "bytes": c["bytes"], "seconds": 0.0})
            entry["seconds"] = max(entry["seconds"], c["seconds"])  # done when the slowest is
    collectives = []
    for entry in groups.values():
        n = len(entry["ranks"])
        nbytes = entry["bytes"]
        alg, bus = sweep.bus_bandwidth(entry["op"], nbytes, n, entry["seconds"])
        collectives.append({"op": entry["op"], "group": entry["kind"],
                            "scope": topology.scope(entry["ranks"], node_of), "ranks": entry["ranks"],
                            "bytes": nbytes, "time_ms": entry["seconds"] * 1e3,
                            "algbw_gbps": alg, "busbw_gbps": bus})
    pairs = []
    for record in per_rank:
        for p in record["pairs"]:
            a, b = p["ranks"]
            pairs.append({"ranks": [a, b], "hosts": [ranks[a]["host"], ranks[b]["host"]],
                          "nodes": [node_of[a], node_of[b]],
                          "scope": topology.scope([a, b], node_of),
                          "round_trip_ms": p["seconds"] * 1e3,
                          "gbps": 2 * info["p2p_bytes"] / max(p["seconds"], 1e-12) / 1e9})
    pairs.sort(key=lambda p: p["ranks"])
    summary: dict[str, dict] = {"intra": {}, "inter": {}}
    rows: dict[tuple, list[dict]] = {}
    for c in collectives:
        rows.setdefault((c["op"], c["group"], c["scope"]), []).append(c)
    table = []
    for (op, kind, where), entries in rows.items():
        bw = sweep.summarize([e["busbw_gbps"] for e in entries])
        table.append({"op": op, "group": kind, "scope": where, "groups": len(entries),
                      "ranks_per_group": len(entries[0]["ranks"]),
                      "max_time_ms": max(e["time_ms"] for e in entries),
                      "min_busbw_gbps": bw["min"], "median_busbw_gbps": bw["median"]})
        s = summary[where].setdefault(op, {"groups": 0, "min_busbw_gbps": math.inf})
        s["groups"] += len(entries)
        s["min_busbw_gbps"] = min(s["min_busbw_gbps"], bw["min"])
    for where in ("intra", "inter"):
        mine = [p for p in pairs if p["scope"] == where]
        if mine:
            bw = sweep.summarize([p["gbps"] for p in mine])
            summary[where]["p2p"] = {"pairs": len(mine), "min_gbps": bw["min"],
                                     "median_gbps": bw["median"], "max_gbps": bw["max"]}
            table.append({"op": "p2p", "group": "rank pairs", "scope": where, "groups": len(mine),
                          "ranks_per_group": 2, "max_time_ms": max(p["round_trip_ms"] for p in mine),
                          "min_busbw_gbps": bw["min"], "median_busbw_gbps": bw["median"]})
    nodes: dict[int, dict] = {}
    for r, node in enumerate(node_of):
        entry = nodes.setdefault(node, {"node": node, "hosts": [], "ranks": []})
        entry["ranks"].append(r)
        if ranks[r]["host"] not in entry["hosts"]:
            entry["hosts"].append(ranks[r]["host"])
    slowest = min(pairs, key=lambda p: p["gbps"]) if pairs else None
    return {**info, "ok": True, "nodes": [nodes[k] for k in sorted(nodes)],
            "ranks": [{**r, "node": node_of[i]} for i, r in enumerate(ranks)],
            "table": table, "summary": summary, "collectives": sorted(
                collectives, key=lambda c: (c["op"], c["group"], c["ranks"])),
            "p2p": {**info["p2p_coverage"], "bytes": info["p2p_bytes"], "pairs": pairs,
                    "slowest": slowest}}


def run(options: PreflightOptions, platform=None) -> Optional[dict]:
    """Run every check on this rank; rank 0 returns the report (others None). Raises
    PreflightError with one line on a failed check ("" when another rank reports it)."""
    if platform is None:
        platform = apply_adaptor()
    started = time.perf_counter()
    pf = _Preflight(options, platform)
    store, join_seconds = pf.join()
    try:
        pf.init_groups(store)
        collectives = pf.collectives()
        pairs, coverage = pf.p2p_sweep()
        gathered = pf.gather(collectives, pairs)
        report = None
        if pf.rank == 0:
            layout = {"tp": options.tp, "pp": options.pp, "ep": options.ep,
                      "dp": pf.world // (options.tp * options.pp)}
            info = {"world_size": pf.world, "platform": platform.name, "backend": platform.backend,
                    "layout": layout, "join_seconds": join_seconds, "bytes": pf.size,
                    "p2p_bytes": pf.p2p_size,
                    "iters": options.iters, "p2p_iters": options.p2p_iters,
                    "p2p_coverage": coverage}
            report = build_report(gathered, pf.ranks, pf.node_of, info)
            report["seconds"] = time.perf_counter() - started
        dist.barrier()
        return report
    finally:
        if dist.is_initialized():
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return (text[0] if text else type(err).__name__)[:300]
