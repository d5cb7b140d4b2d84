#!/usr/bin/env bash
# The main job. With no arguments: a 2-process CPU run with expert parallelism 2 of the built-in
# default (for now the smoke run of a tiny Megatron-Core MoE GPT; the LoRA fine-tuning job and the
# full multi-node launcher arrive with their issues). Extra arguments go to the Python entry point.
#
# Environment (torchrun's names):
#   NPROC_PER_NODE  processes on this node (default: visible GPUs, else 2)
#   NNODES          number of nodes (default 1); NODE_RANK, MASTER_ADDR, MASTER_PORT for several
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/env.sh
slmoe_ensure_env

if [ -z "${NPROC_PER_NODE:-}" ]; then
    NPROC_PER_NODE=2
    if command -v nvidia-smi >/dev/null 2>&1; then
        gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
        [ "$gpus" -gt 0 ] && NPROC_PER_NODE=$gpus
    fi
fi
NNODES=${NNODES:-1}

launch=(torchrun --nproc-per-node "$NPROC_PER_NODE" --nnodes "$NNODES")
if [ "$NNODES" = 1 ] && [ -z "${MASTER_ADDR:-}" ]; then
    launch+=(--standalone)  # single node: torchrun picks a free port itself
else
    launch+=(--node-rank "${NODE_RANK:?set NODE_RANK for a multi-node run}"
             --master-addr "${MASTER_ADDR:?set MASTER_ADDR for a multi-node run}"
             --master-port "${MASTER_PORT:-29500}")
fi

# Reject bad arguments once, in one line, before any process group is formed.
python -m megatron_slmoe.training.smoke --validate-only "$@" || exit $?
exec "${launch[@]}" -m megatron_slmoe.training.smoke "$@"
