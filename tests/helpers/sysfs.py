"""Fake sysfs trees (network interfaces, InfiniBand/RoCE HCAs, ports and GIDs) for the network
profile check and the launcher tests."""

from pathlib import Path

GID_V2 = "0000:0000:0000:0000:0000:ffff:0a4d:0001"


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def fake_sysfs(root: Path, *, interfaces=(("eth0", "up"), ("lo", "unknown")), hcas=None) -> Path:
    """hcas: {name: {port: (state, link_layer, {gid_index: (type, gid)})}}."""
    for name, state in interfaces:
        _write(root / "class" / "net" / name / "operstate", state)
    (root / "class" / "infiniband").mkdir(parents=True, exist_ok=True)
    for hca, ports in (hcas or {}).items():
        for port, (state, link, gids) in ports.items():
            base = root / "class" / "infiniband" / hca / "ports" / str(port)
            _write(base / "state", state)
            _write(base / "link_layer", link)
            for index, (gid_type, gid) in gids.items():
                _write(base / "gid_attrs" / "types" / str(index), gid_type)
                _write(base / "gid_attrs" / "ndevs" / str(index), "eth0")
                _write(base / "gids" / str(index), gid)
    return root


ROCE_GIDS = {0: ("IB/RoCE v1", "fe80:0000:0000:0000:0000:0000:0000:0001"),
             1: ("RoCE v2", "fe80:0000:0000:0000:0000:0000:0000:0001"),
             2: ("IB/RoCE v1", GID_V2), 3: ("RoCE v2", GID_V2),
             4: ("RoCE v2", "0000:0000:0000:0000:0000:0000:0000:0000")}
