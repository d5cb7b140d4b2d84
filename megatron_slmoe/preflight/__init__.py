"""Preflight of a multi-node job: can every rank reach every other, and how fast?

    torchrun ... -m megatron_slmoe.preflight [--report FILE] [preflight flags] [-- training flags]

Run by scripts/pretrain_lora.sh under the same torchrun layout as the training (unless
``--no-preflight`` or ``SLMOE_PREFLIGHT=0``). The training flags (after ``--``, or simply mixed in)
are parsed by the training job's own parser, so the preflight uses the same TP/PP/EP layout,
including one from ``--config``. In order:

1. every rank joins through the rendezvous store within ``--timeout`` seconds; if some do not,
   one line names the missing ranks, their node and the hosts that did join;
2. the process group forms (the platform's backend: gloo, nccl or hccl) and Megatron-Core's
   parallel_state builds the job's groups;
3. a short all-reduce over every data-parallel group and an all-to-all over every
   expert-parallel group, timed; a group that spans nodes with several ranks on a node is also
   timed as its two hops (within each node, across nodes), so both bandwidths are reported;
4. a pairwise point-to-point sweep (rounds of disjoint pairs; capped by ``--p2p-max-rounds`` and
   ``--p2p-time-budget``) that names the slowest pair;
5. rank 0 writes a JSON report and prints a table.

Nodes are torchrun's nodes (GROUP_RANK), or blocks of ``--node-size`` ranks, or hostnames.
Exit codes: 0 fine, 1 a check failed (one line says which), 2 bad flags.
"""

from megatron_slmoe.preflight.runner import PreflightError, PreflightOptions, run  # noqa: F401
