#!/usr/bin/env bash
# One prepared check for a machine with an NVIDIA GPU: build, test, benchmark, train.
#
#   bash tools/bench/gpu_check.sh [OUT_DIR]        # default OUT_DIR: runs/gpu_check (or $OUT)
#
# Steps (each logs to OUT_DIR/<step>.log; a failed step is recorded and the next one runs):
#   env      nvidia-smi, torch/CUDA versions, `python -m megatron_slmoe.platform`
#   build    the CUDA extension in place (SLMOE_BUILD_CUDA=1, sm_80 + sm_90)
#   tests    tests/kernels (the kernel matrix on CPU and CUDA against fp64 references) -> tests.xml
#   bench    tools/bench/lora_expert.py --device cuda (DeepSeek-V3- and Qwen3-like shapes)
#   packed   tools/bench/packed_experts.py --speed --device cuda: the packed LoRA expert op (MXFP4,
#            INT4, block FP8 at K3 / Kimi-K2.5 / DeepSeek-V3 expert shapes) against the op on the
#            BF16-dequantised experts: parity (bit for bit expected) and packed speed = dense time /
#            packed time (target >= 0.8), table in packed.log, JSON in packed_experts_cuda.json
#   kda      fla-core's chunk_kda (Kimi K3's Kimi Delta Attention on CUDA) against the chunked
#            pure-torch path: output and final state (tests/unit/test_kda.py, its CUDA case)
#   train    a short single-GPU bf16 LoRA fine-tune of the `small` config through the normal entry
#            point (full-mode base steps first, then LoRA): tokens/s and peak memory in its metrics
# OUT_DIR/summary.json lists every step with its status and seconds. Exit code: 0 if all passed.
#
# Missing Python packages (megatron-core, tokenizers, ...) can travel as wheels in .whl/: they are
# installed into /tmp/site first when that folder exists. On a machine without CUDA the GPU steps
# report "skipped" and the training step runs a shortened fp32 version on the CPU, which is how
# this script is tested before a GPU is available.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:-${OUT:-runs/gpu_check}}
mkdir -p "$out"
PY=${PYTHON:-python3}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:.${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1

has_cuda=$($PY -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)
statuses=()

step() {  # step NAME COMMAND...: run, log, record status and duration
    local name=$1; shift
    local start=$SECONDS rc
    echo "== $name: $*"
    "$@" >"$out/$name.log" 2>&1
    rc=$?
    tail -n 25 "$out/$name.log"
    statuses+=("\"$name\": {\"status\": \"$([ $rc = 0 ] && echo ok || echo "failed ($rc)")\", \"seconds\": $((SECONDS - start))}")
}

skip() {
    echo "== $1: skipped ($2)"
    statuses+=("\"$1\": {\"status\": \"skipped: $2\", \"seconds\": 0}")
}

step env bash -c "nvidia-smi || true; $PY -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())'; $PY -m megatron_slmoe.platform"

if [ "$has_cuda" = 1 ]; then
    step build env SLMOE_BUILD_CUDA=1 MAX_JOBS="${MAX_JOBS:-16}" $PY setup.py build_ext --inplace
    step tests $PY -m pytest tests/kernels -q -p no:cacheprovider --junitxml "$out/tests.xml"
    step bench $PY tools/bench/lora_expert.py --device cuda --json "$out/lora_expert_cuda.json"
    step packed $PY tools/bench/packed_experts.py --speed --device cuda --json "$out/packed_experts_cuda.json"
    step kda $PY -m pytest tests/unit/test_kda.py -q -p no:cacheprovider -rs -k fla --junitxml "$out/kda.xml"
    train_flags=(--model-config small --bf16 --seq-length 512 --micro-batch-size 8
                 --global-batch-size 32)
    base_iters=30; lora_iters=60; launcher=(torchrun --standalone --nproc-per-node 1)
else
    skip build "no CUDA device"
    skip tests "no CUDA device"
    skip bench "no CUDA device"
    skip packed "no CUDA device"
    skip kda "no CUDA device"
    train_flags=(--model-config tiny --fp32 --seq-length 64 --micro-batch-size 2
                 --global-batch-size 8)
    base_iters=3; lora_iters=4; launcher=(torchrun --standalone --nproc-per-node 1)
fi
common=("${train_flags[@]}" --eval-iters 2 --eval-interval 1000 --log-interval 10
        --no-resume --lr-warmup-iters 2)
step train bash -c "$(printf '%q ' "${launcher[@]}") -m megatron_slmoe.training.finetune $(printf '%q ' "${common[@]}") \
    --finetune-mode full --data-format pretrain --train-iters $base_iters \
    --output-dir $(printf '%q' "$out/base-run") --save-base $(printf '%q' "$out/base") && \
  $(printf '%q ' "${launcher[@]}") -m megatron_slmoe.training.finetune $(printf '%q ' "${common[@]}") \
    --base-checkpoint $(printf '%q' "$out/base") --train-iters $lora_iters \
    --output-dir $(printf '%q' "$out/lora-run")"

{
    echo "{"
    for i in "${!statuses[@]}"; do
        sep=","; [ "$i" = $((${#statuses[@]} - 1)) ] && sep=""
        echo "  ${statuses[$i]}$sep"
    done
    echo "}"
} > "$out/summary.json"
cat "$out/summary.json"
! grep -q '"failed' "$out/summary.json"
