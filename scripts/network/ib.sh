# Network profile "ib": NVIDIA GPUs, NCCL over InfiniBand.
#
# Sourced by scripts/pretrain_lora.sh when NETWORK_PROFILE=ib, then checked against the machine by
# megatron_slmoe/launch/netcheck.py (interfaces and HCAs exist, ports ACTIVE, link layer
# InfiniBand, values in range). Each value below is a default: a variable already set in the
# environment wins; set it to the empty string to leave it to NCCL's own default.
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

# Interface of NCCL's bootstrap (TCP, out of band: rank exchange, not the data path). A comma list
# of name prefixes; "=ib0" matches exactly, "^docker,lo" excludes. Use the interface that carries
# the address the other nodes reach this one on: IPoIB (ib0) or the management ethernet.
slmoe_net_default NCCL_SOCKET_IFNAME ib0
# The HCAs (and optionally ports) NCCL may use for data: prefixes like NCCL_SOCKET_IFNAME;
# "mlx5" takes every mlx5_* device with an ACTIVE port. Pin rails explicitly
# ("=mlx5_0:1,mlx5_1:1,...") when some mlx5 devices are storage or management NICs.
slmoe_net_default NCCL_IB_HCA mlx5
# InfiniBand service level (QoS lane, 0-15) of NCCL's queue pairs. Change only if the fabric
# manager maps a dedicated SL to GPU traffic.
slmoe_net_default NCCL_IB_SL 0
# Verbs ACK timeout, 4.096 us * 2^value (22: ~17 s; NCCL's default 20: ~4 s). Raise it on large
# or congested fabrics that show "transport retry counter exceeded"; 1-31.
slmoe_net_default NCCL_IB_TIMEOUT 22
# Verbs retransmissions before a connection fails (0-7, 7 is the most).
slmoe_net_default NCCL_IB_RETRY_CNT 7
# GPUDirect RDMA: the furthest PCIe distance at which the NIC reads/writes GPU memory directly
# (LOC < PIX < PXB < PHB < SYS). PHB: NIC and GPU under the same CPU socket. Lower it (PXB, LOC)
# if GDR is slow or unstable on this platform; SYS only where cross-socket P2P is known to be good.
slmoe_net_default NCCL_NET_GDR_LEVEL PHB
# Bytes of each NCCL channel's buffer (default 4 MiB). 8 MiB helps large all-to-alls of MoE
# layers; lower it when GPU memory is short (it is per peer and channel).
slmoe_net_default NCCL_BUFFSIZE 8388608
# Warnings only by default; INFO to see the chosen HCAs, rings and transports at start-up.
slmoe_net_default NCCL_DEBUG WARN
