"""Launch-time checks that run before any process group forms (used by scripts/pretrain_lora.sh).

- ``python -m megatron_slmoe.launch.netcheck --profile ib|roce|hccl``: the network profile's
  NCCL_*/HCCL_* settings against this machine (interfaces, HCAs, ports, GID types, value ranges).

Nothing here imports Megatron-Core or touches a device.
"""
