#!/usr/bin/env bash
# Builds the CUDA kernels of csrc/cuda as host C++ on the emulation in this folder (no GPU, no nvcc:
# g++ and the CUDA toolkit's headers) and runs
#   1. emu_test: the dense launchers against an fp64 reference (arguments go to it; --quick: one
#      rank per dtype);
#   2. packed_oracle.py (when $SLMOE_EMU_PYTHON names a Python with torch): the packed launchers
#      (lora_expert_packed.cu), built into a shared library with packed_shim.cpp, against
#      megatron_slmoe.ops' decode and reference, then every injected bug of the packed kernel
#      (SLMOE_MUTANT(n)), each of which must be caught (--no-mutants: skip those).
# Exit status: the first failure's.
#
#   bash csrc/cuda/emu/run.sh [--quick] [--no-mutants]
#
# Needs cuda_bf16.h / cuda_fp16.h / cuda_runtime_api.h: CUDA_HOME, else /usr/local/cuda. Without
# them it prints that it is skipped and exits 0. Environment: CXX, JOBS (parallel compiles, default 2),
# SLMOE_EMU_PYTHON.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
csrc=$(cd "$here/../.." && pwd)
cuda_home=${CUDA_HOME:-/usr/local/cuda}
if [ ! -f "$cuda_home/include/cuda_bf16.h" ]; then
    echo "csrc/cuda/emu: skipped, no CUDA headers under $cuda_home/include (set CUDA_HOME)"
    exit 0
fi
test_args=()
oracle_args=()
for arg in "$@"; do
    case "$arg" in
        --no-mutants) oracle_args+=("$arg") ;;
        *) test_args+=("$arg") ;;
    esac
done
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# The defines torch's extension build passes to nvcc: the kernels must not rely on implicit
# half/bfloat16 conversions. -fPIC: the same objects make the oracle's shared library.
flags=(-std=c++20 -O2 -g -fPIC -Wall -Wextra -Werror -Wno-unknown-pragmas
       -DSLMOE_CUDA_EMU -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__
       -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__
       -I"$cuda_home/include" -I"$csrc")
sources=("$csrc/cuda/lora_expert_kernels.cu" "$csrc/cuda/lora_expert_packed.cu" "$here/cuda_emu.cpp"
         "$here/emu_test.cpp" "$here/packed_shim.cpp")
pids=()
for s in "${sources[@]}"; do  # the slowest (the GEMM templates) first, at most $JOBS at a time
    "${CXX:-g++}" "${flags[@]}" -x c++ -c "$s" -o "$out/$(basename "${s%.*}").o" &
    pids+=($!)
    if [ ${#pids[@]} -ge "${JOBS:-2}" ]; then wait "${pids[0]}"; pids=("${pids[@]:1}"); fi
done
for p in "${pids[@]}"; do wait "$p"; done
kernels=("$out/lora_expert_kernels.o" "$out/lora_expert_packed.o" "$out/cuda_emu.o")
"${CXX:-g++}" "${kernels[@]}" "$out/emu_test.o" -o "$out/emu_test"
"$out/emu_test" "${test_args[@]}"
if [ -n "${SLMOE_EMU_PYTHON:-}" ]; then
    "${CXX:-g++}" -shared "${kernels[@]}" "$out/packed_shim.o" -o "$out/libslmoe_cuda_emu.so"
    "$SLMOE_EMU_PYTHON" "$here/packed_oracle.py" "$out/libslmoe_cuda_emu.so" "${oracle_args[@]}"
fi
