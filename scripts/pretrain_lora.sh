#!/usr/bin/env bash
# The main job: LoRA fine-tuning of a Stable Latent MoE model on Megatron-Core.
#
#   bash scripts/pretrain_lora.sh                 # the built-in demo (below)
#   bash scripts/pretrain_lora.sh [flags...]      # one run of megatron_slmoe.training.finetune
#
# The demo, on a CPU machine with 2 processes and expert parallelism 2:
#   1. once (cached in runs/demo/base): pretrain the tiny base model on the shipped corpus;
#   2. LoRA fine-tune it on the shipped task (digit words -> digits) into runs/demo/lora-<time>;
#   3. report the held-out loss before and after, expert-load health and where the adapter is.
#
# Environment (torchrun's names):
#   NPROC_PER_NODE  processes on this node (default: visible GPUs, else 2)
#   NNODES          number of nodes (default 1); NODE_RANK, MASTER_ADDR, MASTER_PORT for several
# Demo only: SLMOE_DEMO_DIR (default runs/demo), SLMOE_DEMO_BASE_ITERS (300),
#   SLMOE_DEMO_LORA_ITERS (200) — smaller values make a quicker check.
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
launcher=(torchrun --nproc-per-node "$NPROC_PER_NODE" --nnodes "$NNODES")
if [ "$NNODES" = 1 ] && [ -z "${MASTER_ADDR:-}" ]; then
    launcher+=(--standalone)  # single node: torchrun picks a free port itself
else
    launcher+=(--node-rank "${NODE_RANK:?set NODE_RANK for a multi-node run}"
               --master-addr "${MASTER_ADDR:?set MASTER_ADDR for a multi-node run}"
               --master-port "${MASTER_PORT:-29500}")
fi

finetune() {
    # Reject bad arguments once, in one line, before any process group is formed.
    WORLD_SIZE=$((NPROC_PER_NODE * NNODES)) python -m megatron_slmoe.training.finetune \
        --validate-only "$@" || exit $?
    "${launcher[@]}" -m megatron_slmoe.training.finetune "$@"
}

if [ $# -gt 0 ]; then
    finetune "$@"
    exit $?
fi

# --- the built-in demo ---------------------------------------------------------------------------
demo=${SLMOE_DEMO_DIR:-runs/demo}
base_iters=${SLMOE_DEMO_BASE_ITERS:-300}
lora_iters=${SLMOE_DEMO_LORA_ITERS:-200}
common=(--model-config tiny --expert-model-parallel-size 2 --seq-length 128
        --micro-batch-size 4 --global-batch-size 16 --log-interval 25)
if [ ! -f "$demo/base/metadata.json" ]; then
    echo "[demo] pretraining the tiny base model on the shipped corpus -> $demo/base"
    finetune "${common[@]}" --finetune-mode full --data-format pretrain --train-iters "$base_iters" \
        --lr 3e-3 --lr-warmup-iters 10 --eval-interval 100 --save-interval "$base_iters" \
        --output-dir "$demo/base-run" --no-resume --save-base "$demo/base"
else
    echo "[demo] reusing the base model in $demo/base"
fi
run="$demo/lora-$(date +%Y%m%d-%H%M%S)"
echo "[demo] LoRA fine-tuning on the shipped task -> $run"
finetune "${common[@]}" --base-checkpoint "$demo/base" --train-iters "$lora_iters" --lr 2e-3 \
    --lr-warmup-iters 10 \
    --lora-rank 8 --lora-alpha 16 --eval-interval 50 --save-interval 100 --output-dir "$run"
echo "[demo] done: $run/summary.json, adapter in $run/adapter"
