#!/usr/bin/env bash
# Builds the CUDA kernels of csrc/cuda as host C++ on the emulation in this folder (no GPU, no nvcc:
# g++ and the CUDA toolkit's headers) and runs emu_test, which checks the launchers against an fp64
# reference. Arguments go to emu_test (--quick: one rank per dtype). Exit status: emu_test's.
#
#   bash csrc/cuda/emu/run.sh [--quick]
#
# Needs cuda_bf16.h / cuda_fp16.h / cuda_runtime_api.h: CUDA_HOME, else /usr/local/cuda. Without
# them it prints that it is skipped and exits 0.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
csrc=$(cd "$here/../.." && pwd)
cuda_home=${CUDA_HOME:-/usr/local/cuda}
if [ ! -f "$cuda_home/include/cuda_bf16.h" ]; then
    echo "csrc/cuda/emu: skipped, no CUDA headers under $cuda_home/include (set CUDA_HOME)"
    exit 0
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# The defines torch's extension build passes to nvcc: the kernels must not rely on implicit
# half/bfloat16 conversions.
"${CXX:-g++}" -std=c++20 -O2 -g -Wall -Wextra -Werror -Wno-unknown-pragmas \
    -DSLMOE_CUDA_EMU -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ \
    -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__ \
    -I"$cuda_home/include" -I"$csrc" \
    -x c++ "$csrc/cuda/lora_expert_kernels.cu" -x none "$here/cuda_emu.cpp" "$here/emu_test.cpp" \
    -o "$out/emu_test"
"$out/emu_test" "$@"
