#!/usr/bin/env bash
# The package as a cluster image gets it: a wheel built from this checkout (with its native
# kernels), installed non-editable into a fresh virtual environment, run from outside the
# checkout. A module or data file the wheel leaves out fails here, not on a user's cluster.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/env.sh
slmoe_ensure_env  # the build needs the torch the kernels compile against
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
python -m venv "$work/venv"
pip_new() { "$work/venv/bin/python" -m pip install -q "$@"; }
# The CPU torch first: the wheel's plain torch requirement is then met, not a CUDA build pulled.
# It installs while the wheel compiles (the two share nothing; the compile leaves a core idle
# while it links and packs).
pip_new "${SLMOE_TORCH_SPEC:-torch==2.13.0}" &
torch_pid=$!
MAX_JOBS="${MAX_JOBS:-2}" python -m pip wheel . -q --no-build-isolation --no-deps -w "$work/dist"
wait "$torch_pid" || { echo "[wheel] installing torch into the fresh venv failed" >&2; exit 1; }
pip_new "$work"/dist/*.whl
cd "$work"  # away from the checkout: only the installed package can answer
bin="$work/venv/bin"
"$bin/python" - <<'PY'
import megatron_slmoe, os, sys
where = os.path.dirname(megatron_slmoe.__file__)
assert where.startswith(sys.prefix), f"imported {where}, not the installed wheel"
from megatron_slmoe.ops import native_extension_error
assert native_extension_error() is None, f"the wheel's native kernels: {native_extension_error()}"
print(f"[wheel] megatron_slmoe {megatron_slmoe.__version__} from {where}")
PY
# Each script's --help on its own, a process per core at a time (each is one import, on one
# core); xargs exits non-zero when any of them failed, whose error is then printed above.
printf '%s\n' slmoe-finetune slmoe-merge-lora slmoe-generate slmoe-plot-run slmoe-rank-sweep \
        slmoe-convert-hf slmoe-count-params slmoe-make-hf-checkpoint slmoe-preprocess-data \
        slmoe-train-tokenizer slmoe-plan \
        slmoe-preflight slmoe-netcheck |
    xargs -P "$(nproc)" -I{} sh -c '"$1/$2" --help >/dev/null && echo "[wheel] $2 --help: ok"' \
        sh "$bin" {}
"$bin/slmoe-plan" --model-config flagship_2p8t --num-devices 512 \
    --device-memory-gb 141 --top 1 >/dev/null
echo "[wheel] planner on the flagship: ok"
# The demo's first run (its base) as the launcher checks it before torchrun (2 ranks, EP=2),
# then two steps of it for real: the packaged model configs, tokenizer, data and native kernels.
base_run=(--expert-model-parallel-size 2 --finetune-mode full --data-format pretrain
          --train-iters 2 --lr-warmup-iters 0 --eval-iters 1 --eval-interval 2 --save-interval 2
          --no-plots
          --output-dir "$work/base-run" --save-base "$work/base")
WORLD_SIZE=2 "$bin/slmoe-finetune" --validate-only "${base_run[@]}"
echo "[wheel] slmoe-finetune --validate-only of the demo's base run: ok"
"$bin/python" -m torch.distributed.run --nproc-per-node 2 --master-port 29611 \
    -m megatron_slmoe.training.finetune "${base_run[@]}" >"$work/base-run.log" 2>&1 \
    || { tail -30 "$work/base-run.log"; exit 1; }
test -f "$work/base/MANIFEST.json"
echo "[wheel] two steps of the demo's base run under torchrun, base saved: ok"
