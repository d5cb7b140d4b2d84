# Network profile "roce": NVIDIA GPUs, NCCL over RoCE v2 (RDMA over converged Ethernet).
#
# Sourced by scripts/pretrain_lora.sh when NETWORK_PROFILE=roce, then checked against the machine
# by megatron_slmoe/launch/netcheck.py (interfaces and HCAs exist, ports ACTIVE, link layer
# Ethernet, the GID index is a RoCE v2 GID, values in range). Each value below is a default: a
# variable already set in the environment wins; set it to the empty string to leave it to NCCL.
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

# Interface of NCCL's bootstrap (TCP, out of band). A comma list of name prefixes; "=eth0"
# matches exactly, "^docker,lo" excludes. Use the interface with the nodes' routable addresses.
slmoe_net_default NCCL_SOCKET_IFNAME eth0
# The RDMA devices (and optionally ports) NCCL may use: prefixes like NCCL_SOCKET_IFNAME. Pin
# rails explicitly ("=mlx5_0:1,mlx5_1:1,...") when some mlx5 devices are storage/management NICs.
slmoe_net_default NCCL_IB_HCA mlx5
# Index of the GID NCCL addresses peers with. It must be a RoCE v2 GID (routable UDP/IP) bound to
# the address of the RDMA interface: see /sys/class/infiniband/<hca>/ports/1/gid_attrs/types/*
# ("RoCE v2") or `show_gids`. 3 is IPv4 RoCE v2 on a default Mellanox/NVIDIA setup; it changes
# when IPv6 or extra addresses are configured.
slmoe_net_default NCCL_IB_GID_INDEX 3
# IP traffic class (DSCP << 2 | ECN) of NCCL's packets: must match the switches' lossless (PFC /
# ECN) class. 106 = DSCP 26 with ECN, a common RoCE class; ask the network team for yours.
slmoe_net_default NCCL_IB_TC 106
# Verbs ACK timeout, 4.096 us * 2^value (22: ~17 s; NCCL's default 20: ~4 s). Raise it when
# "transport retry counter exceeded" shows up under congestion; 1-31.
slmoe_net_default NCCL_IB_TIMEOUT 22
# Verbs retransmissions before a connection fails (0-7, 7 is the most).
slmoe_net_default NCCL_IB_RETRY_CNT 7
# Queue pairs per connection: more QPs spread one connection over more ECMP paths of a routed
# Ethernet fabric (different UDP source ports). 1 on a single-switch fabric.
slmoe_net_default NCCL_IB_QPS_PER_CONNECTION 4
# GPUDirect RDMA distance limit (LOC < PIX < PXB < PHB < SYS), as in ib.sh.
slmoe_net_default NCCL_NET_GDR_LEVEL PHB
# Bytes of each NCCL channel's buffer (default 4 MiB); 8 MiB helps large MoE all-to-alls.
slmoe_net_default NCCL_BUFFSIZE 8388608
# Warnings only by default; INFO to see the chosen devices, GIDs and transports at start-up.
slmoe_net_default NCCL_DEBUG WARN
