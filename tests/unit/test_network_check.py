"""The network profile check (megatron_slmoe.launch.netcheck) against fake sysfs trees: each
misconfiguration is caught with its own one-line message, and a good machine passes."""

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_slmoe.launch import netcheck
from tests.helpers.sysfs import GID_V2, ROCE_GIDS, fake_sysfs

REPO = Path(__file__).resolve().parents[2]
ROCE_ENV = {"NCCL_SOCKET_IFNAME": "eth0", "NCCL_IB_HCA": "mlx5_0:1", "NCCL_IB_GID_INDEX": "3",
            "NCCL_IB_TC": "106", "NCCL_IB_TIMEOUT": "22", "NCCL_IB_RETRY_CNT": "7",
            "NCCL_NET_GDR_LEVEL": "PHB", "NCCL_BUFFSIZE": "8388608"}


@pytest.fixture
def roce_machine(tmp_path):
    return fake_sysfs(tmp_path / "sys", hcas={
        "mlx5_0": {1: ("4: ACTIVE", "Ethernet", ROCE_GIDS)},
        "mlx5_1": {1: ("1: DOWN", "Ethernet", ROCE_GIDS)},
        "mlx5_bond_0": {1: ("4: ACTIVE", "Ethernet", {3: ("IB/RoCE v1", GID_V2)})},
    })


@pytest.fixture
def ib_machine(tmp_path):
    ib = {0: ("IB/RoCE v1", "fe80:0000:0000:0000:0002:c903:0001:0001")}
    return fake_sysfs(tmp_path / "sys", interfaces=(("ib0", "up"), ("eth0", "up")), hcas={
        "mlx5_0": {1: ("4: ACTIVE", "InfiniBand", ib)},
        "mlx5_1": {1: ("4: ACTIVE", "InfiniBand", ib)},
    })


def _errors(profile, env, root):
    result = netcheck.check(profile, env, str(root))
    for message in result.errors:
        assert "\n" not in message
    return result.errors


def test_good_roce_machine_passes_with_a_summary(roce_machine):
    result = netcheck.check("roce", ROCE_ENV, str(roce_machine))
    assert result.ok, result.errors
    text = "\n".join(result.notes)
    assert "mlx5_0 port 1 ACTIVE Ethernet, GID 3 RoCE v2 on eth0" in text
    assert "NCCL_SOCKET_IFNAME=eth0 -> eth0 (up)" in text
    assert "NCCL_IB_TC=106" in text


def test_good_ib_machine_passes(ib_machine):
    env = {"NCCL_SOCKET_IFNAME": "ib", "NCCL_IB_HCA": "mlx5", "NCCL_IB_TIMEOUT": "22"}
    result = netcheck.check("ib", env, str(ib_machine))
    assert result.ok, result.errors
    assert "mlx5_0 port 1 ACTIVE InfiniBand" in "\n".join(result.notes)


@pytest.mark.parametrize("change, message", [
    ({"NCCL_IB_HCA": "mlx5_7:1"},
     "NCCL_IB_HCA=mlx5_7:1: no HCA matching 'mlx5_7' ({root}/class/infiniband/mlx5_7 does not "
     "exist; present: mlx5_0, mlx5_1, mlx5_bond_0)"),
    ({"NCCL_IB_HCA": "=mlx5_0:2"},
     "NCCL_IB_HCA==mlx5_0:2: mlx5_0 has no port 2 ({root}/class/infiniband/mlx5_0/ports/2 does "
     "not exist; ports: 1)"),
    ({"NCCL_IB_HCA": "mlx5_1:1"},
     "NCCL_IB_HCA=mlx5_1:1: mlx5_1 port 1 is not ACTIVE "
     "({root}/class/infiniband/mlx5_1/ports/1/state reads '1: DOWN')"),
    ({"NCCL_IB_HCA": "mlx5_1"},
     "NCCL_IB_HCA=mlx5_1: mlx5_1 has no ACTIVE port (port 1: 1: DOWN)"),
    ({"NCCL_IB_GID_INDEX": "2"},
     "NCCL_IB_GID_INDEX=2: GID 2 of mlx5_0 port 1 is 'IB/RoCE v1', not 'RoCE v2' "
     "({root}/class/infiniband/mlx5_0/ports/1/gid_attrs/types/2; RoCE v2 GIDs here: 1, 3)"),
    ({"NCCL_IB_GID_INDEX": "0"},
     "NCCL_IB_GID_INDEX=0: GID 0 of mlx5_0 port 1 is 'IB/RoCE v1', not 'RoCE v2' "
     "({root}/class/infiniband/mlx5_0/ports/1/gid_attrs/types/0; RoCE v2 GIDs here: 1, 3)"),
    ({"NCCL_IB_GID_INDEX": "4"},
     "NCCL_IB_GID_INDEX=4: GID 4 of mlx5_0 port 1 is empty (no address bound to it; "
     "RoCE v2 GIDs here: 1, 3)"),
    ({"NCCL_IB_GID_INDEX": "9"},
     "NCCL_IB_GID_INDEX=9: mlx5_0 port 1 has no GID 9 "
     "({root}/class/infiniband/mlx5_0/ports/1/gid_attrs/types/9 does not exist; "
     "RoCE v2 GIDs here: 1, 3)"),
    ({"NCCL_SOCKET_IFNAME": "ens"},
     "NCCL_SOCKET_IFNAME=ens: no interface matching 'ens' ({root}/class/net/ens does not exist; "
     "present: eth0, lo)"),
    ({"NCCL_SOCKET_IFNAME": "=eth"},
     "NCCL_SOCKET_IFNAME==eth: no interface named 'eth' ({root}/class/net/eth does not exist; "
     "present: eth0, lo)"),
    ({"NCCL_SOCKET_IFNAME": "^eth,lo"},
     "NCCL_SOCKET_IFNAME=^eth,lo: excludes every interface of this machine (present: eth0, lo)"),
    ({"GLOO_SOCKET_IFNAME": "eth1"},
     "GLOO_SOCKET_IFNAME=eth1: no interface named 'eth1' ({root}/class/net/eth1 does not exist; "
     "present: eth0, lo)"),
    ({"NCCL_IB_TC": "300"}, "NCCL_IB_TC=300: must be in [0, 255]"),
    ({"NCCL_IB_TIMEOUT": "fast"}, "NCCL_IB_TIMEOUT=fast: is not an integer"),
    ({"NCCL_IB_RETRY_CNT": "9"}, "NCCL_IB_RETRY_CNT=9: must be in [0, 7]"),
    ({"NCCL_NET_GDR_LEVEL": "NEAR"},
     "NCCL_NET_GDR_LEVEL=NEAR: must be one of LOC, PIX, PXB, PHB, SYS (or 0-5)"),
])
def test_each_roce_misconfiguration_has_its_own_message(roce_machine, change, message):
    errors = _errors("roce", {**ROCE_ENV, **change}, roce_machine)
    assert errors == [message.format(root=roce_machine)]


def test_missing_gid_index_for_roce(roce_machine):
    env = {k: v for k, v in ROCE_ENV.items() if k != "NCCL_IB_GID_INDEX"}
    (error,) = _errors("roce", env, roce_machine)
    assert error.startswith("NCCL_IB_GID_INDEX is not set: RoCE needs the index of a RoCE v2 GID")


def test_exact_list_needs_every_named_port(roce_machine):
    errors = _errors("roce", {**ROCE_ENV, "NCCL_IB_HCA": "=mlx5_0,mlx5_1:1"}, roce_machine)
    assert errors == [f"NCCL_IB_HCA==mlx5_0,mlx5_1:1: mlx5_1 port 1 is not ACTIVE "
                      f"({roce_machine}/class/infiniband/mlx5_1/ports/1/state reads '1: DOWN')"]


def test_prefix_hca_skips_a_down_device_but_checks_the_others(roce_machine):
    # "mlx5_" matches mlx5_0 (good), mlx5_1 (DOWN: NCCL skips it) and mlx5_bond_0 (GID 3 is v1)
    result = netcheck.check("roce", {**ROCE_ENV, "NCCL_IB_HCA": "mlx5_"}, str(roce_machine))
    assert result.errors == [
        "NCCL_IB_GID_INDEX=3: GID 3 of mlx5_bond_0 port 1 is 'IB/RoCE v1', not 'RoCE v2' "
        f"({roce_machine}/class/infiniband/mlx5_bond_0/ports/1/gid_attrs/types/3; "
        "RoCE v2 GIDs here: none)"]
    assert "mlx5_1: skipped, no ACTIVE port" in result.notes


def test_prefix_hca_with_no_active_port_at_all(tmp_path):
    down = ("1: DOWN", "Ethernet", ROCE_GIDS)
    root = fake_sysfs(tmp_path / "sys", hcas={"mlx5_0": {1: down}, "mlx5_1": {1: down}})
    assert _errors("roce", {**ROCE_ENV, "NCCL_IB_HCA": "mlx5"}, root) == [
        "NCCL_IB_HCA=mlx5: none of mlx5_0, mlx5_1 has an ACTIVE port"]


def test_no_hca_at_all(tmp_path):
    root = fake_sysfs(tmp_path / "sys")
    errors = _errors("roce", ROCE_ENV, root)
    assert errors == [f"NCCL_IB_HCA=mlx5_0:1: no HCA matching 'mlx5_0' "
                      f"({root}/class/infiniband/mlx5_0 does not exist; present: none)"]


def test_ib_profile_refuses_an_ethernet_port(roce_machine):
    errors = _errors("ib", {"NCCL_SOCKET_IFNAME": "eth0", "NCCL_IB_HCA": "mlx5_0:1"}, roce_machine)
    assert errors == [f"NCCL_IB_HCA=mlx5_0:1: mlx5_0 port 1 is Ethernet, not InfiniBand (profile ib; "
                      f"{roce_machine}/class/infiniband/mlx5_0/ports/1/link_layer)"]


def test_down_interface(tmp_path):
    root = fake_sysfs(tmp_path / "sys", interfaces=(("eth0", "down"), ("eth1", "up")))
    errors = _errors("hccl", {"HCCL_SOCKET_IFNAME": "eth0"}, root)
    assert errors == [f"HCCL_SOCKET_IFNAME=eth0: interface eth0 is down "
                      f"({root}/class/net/eth0/operstate reads 'down')"]


def test_hccl_profile(tmp_path):
    root = fake_sysfs(tmp_path / "sys")
    good = {"HCCL_SOCKET_IFNAME": "eth", "HCCL_IF_IP": "127.0.0.1", "HCCL_CONNECT_TIMEOUT": "1200",
            "HCCL_EXEC_TIMEOUT": "1800", "HCCL_BUFFSIZE": "200", "HCCL_RDMA_TC": "132"}
    result = netcheck.check("hccl", good, str(root))
    assert result.ok, result.errors
    bad = {**good, "HCCL_IF_IP": "192.0.2.77", "HCCL_CONNECT_TIMEOUT": "30",
           "HCCL_RDMA_TC": "130", "HCCL_BUFFSIZE": "0"}
    assert _errors("hccl", bad, root) == [
        "HCCL_IF_IP=192.0.2.77: not an address of this machine",
        "HCCL_CONNECT_TIMEOUT=30: must be in [120, 7200]",
        "HCCL_BUFFSIZE=0: must be >= 1",
        "HCCL_RDMA_TC=130: must be a multiple of 4",
    ]
    assert _errors("hccl", {"HCCL_IF_IP": "10.0.0.300"}, root) == [
        "HCCL_IF_IP=10.0.0.300: not an IP address"]


def test_command_line_one_line_per_failure_and_exit_2(roce_machine):
    # Run as the launcher runs it: the file itself, standard library only.
    env = {"PATH": "/usr/bin:/bin", **ROCE_ENV, "NCCL_IB_GID_INDEX": "2"}
    proc = subprocess.run([sys.executable, str(REPO / "megatron_slmoe/launch/netcheck.py"),
                           "--profile", "roce", "--sysfs-root", str(roce_machine)],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("netcheck: NCCL_IB_GID_INDEX=2")
    ok = subprocess.run([sys.executable, str(REPO / "megatron_slmoe/launch/netcheck.py"),
                         "--profile", "roce"], env={**env, "NCCL_IB_GID_INDEX": "3",
                                                    "SLMOE_SYSFS_ROOT": str(roce_machine)},
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("[netcheck] profile roce: ok")
