# Network profile "hccl": Huawei Ascend NPUs, HCCL (torch_npu) over the NPUs' RoCE ports.
#
# Sourced by scripts/pretrain_lora.sh when NETWORK_PROFILE=hccl, then checked against the machine
# by megatron_slmoe/launch/netcheck.py (the host interface exists and is up, HCCL_IF_IP is local,
# values in their documented ranges). The NPU ports themselves are configured with hccn_tool
# (/etc/hccn.conf), outside this profile. Each value below is a default: a variable already set in
# the environment wins; set it to the empty string to leave it to HCCL's own default.
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

# Host interface of HCCL's TCP set-up (rank table exchange), NCCL-style list: prefixes, "=name"
# exact, "^name" excluded. Use the interface with the nodes' routable addresses.
# HCCL_IF_IP (one IP address of this host), when set, takes precedence: set it per node where
# the interface names differ between nodes.
slmoe_net_default HCCL_SOCKET_IFNAME eth0
# Seconds the ranks wait for each other while building communicators (default 120, range
# 120-7200). Raise it for jobs with hundreds of nodes, or slow starts (large images, shared FS).
slmoe_net_default HCCL_CONNECT_TIMEOUT 1200
# Seconds one collective may wait for its peers before HCCL aborts it (range 0-17340; 0 never).
# Keep it above the longest gap between collectives (first-step graph compilation, checkpoint
# saves), and in step with --distributed-timeout-minutes of the job.
slmoe_net_default HCCL_EXEC_TIMEOUT 1800
# MB of the buffer each communicator shares between two NPUs (default 200). MoE all-to-alls of
# long sequences use more: raise it (e.g. 400) if HCCL splits transfers; lower it if memory is short.
slmoe_net_default HCCL_BUFFSIZE 200
# RoCE traffic class of the NPU ports (DSCP << 2, a multiple of 4; 132 = DSCP 33, HCCL's default):
# must match the switches' lossless class.
slmoe_net_default HCCL_RDMA_TC 132
# RoCE priority (service level, 0-7; 4 is HCCL's default): the PFC priority of that class.
slmoe_net_default HCCL_RDMA_SL 4
# Inside a server, 8 NPUs talk over HCCS/PCIe (1) rather than RoCE (0): keep unless told otherwise.
slmoe_net_default HCCL_INTRA_PCIE_ENABLE 1
slmoe_net_default HCCL_INTRA_ROCE_ENABLE 0
