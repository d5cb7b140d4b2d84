"""Check a network profile's NCCL_* / HCCL_* settings against this machine before launch.

    python -m megatron_slmoe.launch.netcheck --profile roce [--sysfs-root /fake/sys]

The profile scripts (``scripts/network/{ib,roce,hccl}.sh``) export the variables; this reads them
from the environment and checks what the machine can confirm, through sysfs only:

- every interface named by NCCL_SOCKET_IFNAME / HCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME exists
  (``<sysfs>/class/net/<if>``; NCCL's prefix, ``=exact`` and ``^exclude`` syntax) and is not down;
- every HCA named by NCCL_IB_HCA exists (``<sysfs>/class/infiniband/<hca>``), its port (the named
  one, or any) is ACTIVE (``ports/<port>/state``), and its link layer suits the profile
  (InfiniBand for ``ib``, Ethernet for ``roce``);
- for ``roce``, NCCL_IB_GID_INDEX is a RoCE v2 GID on each used port
  (``ports/<port>/gid_attrs/types/<index>`` reads "RoCE v2") and is not empty;
- HCCL_IF_IP is an address of this machine; numeric settings are in their documented ranges.

Each failure is one line on stderr; any failure exits with code 2. Success prints a short summary.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import os
import socket
import sys
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

PROFILES = ("ib", "roce", "hccl")
SYSFS_ENV = "SLMOE_SYSFS_ROOT"

# name -> (check, what it must be); ranges as documented by NCCL / CANN.
_GDR_LEVELS = ("LOC", "PIX", "PXB", "PHB", "SYS")


def _int_range(lo: int, hi: Optional[int] = None, multiple: int = 1) -> Callable[[str], Optional[str]]:
    def check(value: str) -> Optional[str]:
        try:
            number = int(value, 10)
        except ValueError:
            return "is not an integer"
        if number < lo or (hi is not None and number > hi):
            return f"must be in [{lo}, {hi}]" if hi is not None else f"must be >= {lo}"
        if number % multiple:
            return f"must be a multiple of {multiple}"
        return None
    return check


def _choice(*allowed: str) -> Callable[[str], Optional[str]]:
    def check(value: str) -> Optional[str]:
        return None if value in allowed else f"must be one of {', '.join(allowed)}"
    return check


def _gdr_level(value: str) -> Optional[str]:
    if value.upper() in _GDR_LEVELS or (value.isdigit() and int(value) <= 5):
        return None
    return f"must be one of {', '.join(_GDR_LEVELS)} (or 0-5)"


NCCL_VALUES: dict[str, Callable[[str], Optional[str]]] = {
    "NCCL_IB_GID_INDEX": _int_range(0, 255),
    "NCCL_IB_TC": _int_range(0, 255),
    "NCCL_IB_SL": _int_range(0, 15),
    "NCCL_IB_TIMEOUT": _int_range(1, 31),
    "NCCL_IB_RETRY_CNT": _int_range(0, 7),
    "NCCL_IB_QPS_PER_CONNECTION": _int_range(1, 128),
    "NCCL_NET_GDR_LEVEL": _gdr_level,
    "NCCL_BUFFSIZE": _int_range(65536),
    "NCCL_IB_DISABLE": _choice("0", "1"),
}
HCCL_VALUES: dict[str, Callable[[str], Optional[str]]] = {
    "HCCL_CONNECT_TIMEOUT": _int_range(120, 7200),
    "HCCL_EXEC_TIMEOUT": _int_range(0, 17340),
    "HCCL_BUFFSIZE": _int_range(1),
    "HCCL_RDMA_TC": _int_range(0, 255, multiple=4),
    "HCCL_RDMA_SL": _int_range(0, 7),
    "HCCL_INTRA_ROCE_ENABLE": _choice("0", "1"),
    "HCCL_INTRA_PCIE_ENABLE": _choice("0", "1"),
    "HCCL_SOCKET_FAMILY": _choice("AF_INET", "AF_INET6"),
}


@dataclass
class Result:
    profile: str
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


def _read(path: str) -> Optional[str]:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _parse_list(spec: str) -> tuple[bool, bool, list[str]]:
    """NCCL's list syntax: '^' excludes, '=' means exact names; returns (exclude, exact, items)."""
    exclude = spec.startswith("^")
    spec = spec[1:] if exclude else spec
    exact = spec.startswith("=")
    spec = spec[1:] if exact else spec
    return exclude, exact, [item.strip() for item in spec.split(",") if item.strip()]


class Checker:
    def __init__(self, profile: str, env: Mapping[str, str], sysfs_root: str = "/sys") -> None:
        if profile not in PROFILES:
            raise ValueError(f"unknown profile {profile!r} (one of {', '.join(PROFILES)})")
        self.profile, self.env, self.sys = profile, env, sysfs_root
        self.result = Result(profile)

    # -- helpers ---------------------------------------------------------------------------------

    def error(self, message: str) -> None:
        self.result.errors.append(message)

    def note(self, message: str) -> None:
        self.result.notes.append(message)

    def _net(self, *parts: str) -> str:
        return os.path.join(self.sys, "class", "net", *parts)

    def _ib(self, *parts: str) -> str:
        return os.path.join(self.sys, "class", "infiniband", *parts)

    # -- interfaces ------------------------------------------------------------------------------

    def check_interfaces(self, var: str, prefix_syntax: bool = True) -> None:
        spec = self.env.get(var, "").strip()
        if not spec:
            return
        present = _listdir(self._net())
        if prefix_syntax:
            exclude, exact, names = _parse_list(spec)
        else:  # GLOO_SOCKET_IFNAME: exact names, comma separated
            exclude, exact, names = False, True, [n.strip() for n in spec.split(",") if n.strip()]
        if exclude:
            left = [i for i in present if i != "lo" and not any(
                i == n if exact else i.startswith(n) for n in names)]
            if not left:
                self.error(f"{var}={spec}: excludes every interface of this machine "
                           f"(present: {', '.join(present) or 'none'})")
            else:
                self.note(f"{var}={spec} -> {', '.join(left)}")
            return
        chosen = []
        for name in names:
            matches = [i for i in present if (i == name if exact else i.startswith(name))]
            if not matches:
                self.error(f"{var}={spec}: no interface {'named' if exact else 'matching'} "
                           f"{name!r} ({self._net(name)} does not exist; present: "
                           f"{', '.join(present) or 'none'})")
                continue
            for iface in matches:
                state = _read(self._net(iface, "operstate"))
                if state == "down":
                    self.error(f"{var}={spec}: interface {iface} is down "
                               f"({self._net(iface, 'operstate')} reads 'down')")
                else:
                    chosen.append(f"{iface} ({state or 'state unknown'})")
        if chosen:
            self.note(f"{var}={spec} -> {', '.join(chosen)}")

    # -- HCAs ------------------------------------------------------------------------------------

    def check_hcas(self) -> None:
        spec = self.env.get("NCCL_IB_HCA", "").strip()
        if self.env.get("NCCL_IB_DISABLE", "0") == "1":
            self.note("NCCL_IB_DISABLE=1: HCAs not used")
            return
        present = _listdir(self._ib())
        if not spec:
            if not present:
                self.error(f"NCCL_IB_HCA is not set and this machine has no HCA "
                           f"({self._ib()} is empty or missing)")
                return
            spec = ",".join(present)
            self.note(f"NCCL_IB_HCA unset: NCCL picks among {spec}")
        exclude, exact, entries = _parse_list(spec)
        if exclude:
            left = [h for h in present if not any(
                h == e.split(":")[0] if exact else h.startswith(e.split(":")[0]) for e in entries)]
            if not left:
                self.error(f"NCCL_IB_HCA={spec}: excludes every HCA of this machine "
                           f"(present: {', '.join(present) or 'none'})")
            for hca in left:
                self._check_ports(hca, None, strict=False, spec=spec)
            return
        for entry in entries:
            name, _, port = entry.partition(":")
            if port and not port.isdigit():
                self.error(f"NCCL_IB_HCA={spec}: port {port!r} of {name} is not a number")
                continue
            matches = [h for h in present if (h == name if exact else h.startswith(name))]
            if not matches:
                self.error(f"NCCL_IB_HCA={spec}: no HCA {'named' if exact else 'matching'} "
                           f"{name!r} ({self._ib(name)} does not exist; present: "
                           f"{', '.join(present) or 'none'})")
                continue
            # A name that is a device exactly, or a port: every match must work. A bare prefix
            # (NCCL picks among several): at least one must, the others are listed as skipped.
            strict = bool(port) or exact or name in matches
            usable = [h for h in matches if self._check_ports(
                h, port or None, strict=strict or len(matches) == 1, spec=spec)]
            if not strict and len(matches) > 1 and not usable:
                self.error(f"NCCL_IB_HCA={spec}: none of {', '.join(matches)} has an ACTIVE port")

    def _check_ports(self, hca: str, port: Optional[str], strict: bool, spec: str) -> bool:
        """Check one HCA (one named port, or all its ports); record errors when strict."""
        ports_dir = self._ib(hca, "ports")
        ports = [port] if port else _listdir(ports_dir)
        if port and not os.path.isdir(os.path.join(ports_dir, port)):
            self.error(f"NCCL_IB_HCA={spec}: {hca} has no port {port} "
                       f"({os.path.join(ports_dir, port)} does not exist; ports: "
                       f"{', '.join(_listdir(ports_dir)) or 'none'})")
            return False
        if not ports:
            if strict:
                self.error(f"NCCL_IB_HCA={spec}: {hca} has no ports ({ports_dir} is empty)")
            return False
        active = []
        for p in ports:
            state_file = os.path.join(ports_dir, p, "state")
            state = _read(state_file) or "missing"
            if "ACTIVE" not in state.upper():
                if port and strict:
                    self.error(f"NCCL_IB_HCA={spec}: {hca} port {p} is not ACTIVE "
                               f"({state_file} reads {state!r})")
                continue
            active.append(p)
        if not active:
            if strict and not port:
                states = ", ".join(f"port {p}: {_read(os.path.join(ports_dir, p, 'state')) or 'missing'}"
                                   for p in ports)
                self.error(f"NCCL_IB_HCA={spec}: {hca} has no ACTIVE port ({states})")
            elif not strict:
                self.note(f"{hca}: skipped, no ACTIVE port")
            return False
        ok = True
        described = []
        for p in active:
            link = _read(os.path.join(ports_dir, p, "link_layer"))
            want = {"ib": "InfiniBand", "roce": "Ethernet"}.get(self.profile)
            if link and want and link != want:
                self.error(f"NCCL_IB_HCA={spec}: {hca} port {p} is {link}, not {want} "
                           f"(profile {self.profile}; {os.path.join(ports_dir, p, 'link_layer')})")
                ok = False
                continue
            text = f"{hca} port {p} ACTIVE" + (f" {link}" if link else "")
            if self.profile == "roce":
                gid = self._check_gid(hca, p, spec)
                if gid is None:
                    ok = False
                    continue
                text += gid
            described.append(text)
        if described:
            self.note("NCCL_IB_HCA -> " + "; ".join(described))
        return ok

    def _check_gid(self, hca: str, port: str, spec: str) -> Optional[str]:
        index = self.env.get("NCCL_IB_GID_INDEX", "").strip()
        if not index:
            self.error("NCCL_IB_GID_INDEX is not set: RoCE needs the index of a RoCE v2 GID "
                       f"(see {self._ib(hca, 'ports', port, 'gid_attrs', 'types')})")
            return None
        if not index.isdigit():
            return None  # reported by the value check
        types_dir = self._ib(hca, "ports", port, "gid_attrs", "types")
        type_file = os.path.join(types_dir, index)
        gid_type = _read(type_file)
        v2 = [i for i in _listdir(types_dir) if (_read(os.path.join(types_dir, i)) or "") == "RoCE v2"
              and not _empty_gid(_read(self._ib(hca, "ports", port, "gids", i)))]
        hint = f"RoCE v2 GIDs here: {', '.join(sorted(v2, key=int)) if v2 else 'none'}"
        if gid_type is None:
            self.error(f"NCCL_IB_GID_INDEX={index}: {hca} port {port} has no GID {index} "
                       f"({type_file} does not exist; {hint})")
            return None
        if gid_type != "RoCE v2":
            self.error(f"NCCL_IB_GID_INDEX={index}: GID {index} of {hca} port {port} is "
                       f"{gid_type!r}, not 'RoCE v2' ({type_file}; {hint})")
            return None
        gid = _read(self._ib(hca, "ports", port, "gids", index))
        if gid is not None and _empty_gid(gid):
            self.error(f"NCCL_IB_GID_INDEX={index}: GID {index} of {hca} port {port} is empty "
                       f"(no address bound to it; {hint})")
            return None
        ndev = _read(self._ib(hca, "ports", port, "gid_attrs", "ndevs", index))
        return f", GID {index} RoCE v2" + (f" on {ndev}" if ndev else "")

    # -- values ----------------------------------------------------------------------------------

    def check_values(self, table: Mapping[str, Callable[[str], Optional[str]]]) -> None:
        shown = []
        for var, check in table.items():
            value = self.env.get(var)
            if value is None or value == "":
                continue
            problem = check(value.strip())
            if problem:
                self.error(f"{var}={value}: {problem}")
            else:
                shown.append(f"{var}={value}")
        if shown:
            self.note(" ".join(shown))

    def check_local_ip(self, var: str) -> None:
        value = self.env.get(var, "").strip()
        if not value:
            return
        try:
            address = ipaddress.ip_address(value)
        except ValueError:
            self.error(f"{var}={value}: not an IP address")
            return
        family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((value, 0))
            except OSError as err:
                if err.errno == errno.EADDRNOTAVAIL:
                    self.error(f"{var}={value}: not an address of this machine")
                else:
                    self.error(f"{var}={value}: cannot bind to it ({err.strerror})")
                return
        self.note(f"{var}={value} (local)")

    # -- profiles --------------------------------------------------------------------------------

    def run(self) -> Result:
        if self.profile in ("ib", "roce"):
            self.check_interfaces("NCCL_SOCKET_IFNAME")
            self.check_values(NCCL_VALUES)
            self.check_hcas()
        else:
            if self.env.get("HCCL_IF_IP"):
                self.check_local_ip("HCCL_IF_IP")
            self.check_interfaces("HCCL_SOCKET_IFNAME")
            self.check_values(HCCL_VALUES)
        self.check_interfaces("GLOO_SOCKET_IFNAME", prefix_syntax=False)
        return self.result


def _empty_gid(gid: Optional[str]) -> bool:
    return gid is not None and set(gid.replace(":", "")) <= {"0"}


def check(profile: str, env: Optional[Mapping[str, str]] = None, sysfs_root: Optional[str] = None) -> Result:
    """Check ``profile`` against this machine (or a fake sysfs tree); never raises on bad values."""
    env = os.environ if env is None else env
    root = sysfs_root or env.get(SYSFS_ENV) or "/sys"
    return Checker(profile, env, root).run()


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_slmoe.launch.netcheck",
        description="Check a network profile's NCCL_*/HCCL_* settings against this machine.")
    parser.add_argument("--profile", required=True, choices=PROFILES)
    parser.add_argument("--sysfs-root", default=None,
                        help=f"read sysfs from here instead of /sys (tests; or ${SYSFS_ENV})")
    parser.add_argument("--quiet", action="store_true", help="print nothing on success")
    args = parser.parse_args(argv)
    result = check(args.profile, sysfs_root=args.sysfs_root)
    for message in result.errors:
        print(f"netcheck: {message}", file=sys.stderr)
    if not result.ok:
        return 2
    if not args.quiet:
        print(f"[netcheck] profile {args.profile}: ok")
        for note in result.notes:
            print(f"[netcheck]   {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
