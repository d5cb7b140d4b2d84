#!/usr/bin/env bash
# CI check of the CUDA kernels on a machine without a GPU (and with a CPU-only torch):
#
#   1. nvcc compiles every csrc/cuda/*.cu for sm_80 and sm_90 (-c, objects in a temp dir) with the
#      flags torch's extension build uses, every warning an error (host compiler, nvcc, ptxas,
#      register spills included);
#   2. the host compiler checks csrc/cuda/*.cpp (the torch binding) against torch's headers, if a
#      Python with torch is importable;
#   3. the kernels run on the host emulation in csrc/cuda/emu: the dense launchers against an fp64
#      reference (--quick set), and, with a Python with torch, the packed launchers (MXFP4, INT4,
#      block FP8) against megatron_slmoe.ops' decode and reference, then every injected bug of the
#      packed kernel, each of which must be caught (skip all of step 3 with --no-emu).
#
# No nvcc (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin): says the check is skipped and exits 0.
# Any compile error or failed emulated case: non-zero exit.
#
#   bash .ci/compile_cuda.sh [--no-emu]
# Environment: MAX_JOBS (nvcc --threads, default 1), PYTHON (default: .venv/bin/python, else python,
# else python3), CUDA_HOME, CXX.
set -euo pipefail
cd "$(dirname "$0")/.."

run_emu=1
for arg in "$@"; do
    case "$arg" in
        --no-emu) run_emu=0 ;;
        *) echo "usage: $0 [--no-emu]" >&2; exit 2 ;;
    esac
done

nvcc=$(command -v nvcc || true)
for cand in "${CUDA_HOME:+$CUDA_HOME/bin/nvcc}" /usr/local/cuda/bin/nvcc; do
    if [ -z "$nvcc" ] && [ -n "$cand" ] && [ -x "$cand" ]; then nvcc=$cand; fi
done
if [ -z "$nvcc" ]; then
    echo "compile_cuda: skipped, no nvcc found (PATH, \$CUDA_HOME/bin, /usr/local/cuda/bin)"
    exit 0
fi
# The toolkit root, for its headers in steps 2 and 3 (nvcc itself may be a wrapper script elsewhere):
# $CUDA_HOME, else where nvcc says it lives (its --dryrun TOP), else /usr/local/cuda.
cuda_home=""
top=$("$nvcc" --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -n 1)
for cand in "${CUDA_HOME:-}" "$top" /usr/local/cuda; do
    if [ -z "$cuda_home" ] && [ -n "$cand" ] && [ -f "$cand/include/cuda_runtime_api.h" ]; then
        cuda_home=$(cd "$cand" && pwd)
    fi
done
if [ -z "$cuda_home" ]; then
    echo "compile_cuda: nvcc is $nvcc but no CUDA headers were found; set CUDA_HOME" >&2
    exit 1
fi
export CUDA_HOME=$cuda_home

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
SECONDS=0
echo "compile_cuda: $nvcc ($("$nvcc" --version | tail -n 1)), headers in $cuda_home/include"

# Step 1. The defines and options torch.utils.cpp_extension gives nvcc (COMMON_NVCC_FLAGS, C++20),
# plus setup.py's own (-O3, the two architectures).
nvcc_flags=(
    -std=c++20 -O3
    -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__
    -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__ --expt-relaxed-constexpr
    -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90,code=sm_90
    -Icsrc
    -Werror all-warnings -Xptxas -warn-spills,-Werror -Xcompiler -fPIC,-Wall,-Wextra,-Werror
    --threads "${MAX_JOBS:-1}"
)
shopt -s nullglob
cu_sources=(csrc/cuda/*.cu)
if [ ${#cu_sources[@]} -eq 0 ]; then
    echo "compile_cuda: no csrc/cuda/*.cu sources" >&2
    exit 1
fi
for src in "${cu_sources[@]}"; do
    obj="$tmp/$(basename "$src" .cu).o"
    "$nvcc" "${nvcc_flags[@]}" -c "$src" -o "$obj"
    echo "compile_cuda: ok  $src (sm_80, sm_90) [${SECONDS}s]"
done

# Step 2. The binding needs torch's headers; a CPU-only torch ships the c10/cuda headers but not the
# generated cuda_cmake_macros.h, which only carries export macros, so it is skipped for the check.
cpp_sources=(csrc/cuda/*.cpp)
python=${PYTHON:-}
if [ -z "$python" ] && [ -x .venv/bin/python ]; then python=.venv/bin/python; fi  # scripts/test.sh's venv
if [ -z "$python" ]; then python=$(command -v python || command -v python3 || true); fi
torch_includes=""
if [ ${#cpp_sources[@]} -gt 0 ] && [ -n "$python" ]; then
    torch_includes=$("$python" -c 'from torch.utils.cpp_extension import include_paths; print(" ".join(include_paths()))' 2>/dev/null || true)
fi
if [ ${#cpp_sources[@]} -gt 0 ] && [ -z "$torch_includes" ]; then
    echo "compile_cuda: skipped the binding check, no Python with torch"
elif [ ${#cpp_sources[@]} -gt 0 ]; then
    cxx_flags=(-std=c++20 -fsyntax-only -Wall -Wextra -Werror -Icsrc -isystem "$cuda_home/include")
    for inc in $torch_includes; do cxx_flags+=(-isystem "$inc"); done
    if [ ! -f "$(echo "$torch_includes" | cut -d' ' -f1)/c10/cuda/impl/cuda_cmake_macros.h" ]; then
        cxx_flags+=(-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE)
    fi
    for src in "${cpp_sources[@]}"; do
        "${CXX:-g++}" "${cxx_flags[@]}" "$src"
        echo "compile_cuda: ok  $src (host compiler, torch headers) [${SECONDS}s]"
    done
fi

# Step 3.
if [ "$run_emu" = 1 ]; then
    if [ -n "$torch_includes" ]; then export SLMOE_EMU_PYTHON=$python; else unset SLMOE_EMU_PYTHON; fi
    if ! out=$(bash csrc/cuda/emu/run.sh --quick 2>&1); then
        echo "$out"
        echo "compile_cuda: FAILED, emulated kernels disagree with the reference (csrc/cuda/emu)" >&2
        exit 1
    fi
    echo "compile_cuda: ok  emulated kernels (csrc/cuda/emu): $(echo "$out" | grep -m1 '^all .* cases passed') [${SECONDS}s]"
    if [ -n "$torch_includes" ]; then
        echo "compile_cuda: ok  emulated packed kernels vs megatron_slmoe.ops: $(echo "$out" | grep -m1 '^packed oracle:'); $(echo "$out" | grep -m1 '^packed injected bugs caught:')"
    else
        echo "compile_cuda: skipped the packed kernels' oracle, no Python with torch"
    fi
fi
echo "compile_cuda: passed in ${SECONDS}s"
