#!/usr/bin/env bash
# CI check of the AscendC kernels (csrc/ascendc) on a machine without CANN or an NPU:
#
#   1. with CANN (ASCEND_HOME_PATH with AscendC's CMake support): CANN's toolchain compiles the
#      kernel library (csrc/ascendc/CMakeLists.txt, SOC_VERSION from SLMOE_ASCEND_SOC, default
#      Ascend910B1); without CANN this step says it is skipped;
#   2. the host compiler checks the torch_npu binding (lora_expert_npu.cpp, -fsyntax-only, warnings
#      are errors) against torch's, torch_npu's and CANN's headers where all are installed; elsewhere
#      step 3 compiles it against torch's headers and the stand-ins in csrc/ascendc/emu/stubs (with
#      --no-emu, this step does, -fsyntax-only);
#   3. the kernel's own source runs on the host emulation (csrc/ascendc/emu/run.sh): the planner's
#      unit tests, the emulation's self-test against CANN's documented data flow, the emulated
#      kernel against an fp64 reference (--quick set), the binding on CPU tensors with the emulated
#      kernels (with torch; its packed ops against decode-then-dense), and every injected bug, which must be caught; with torch, the packed-
#      weight path (packed_decode_kernel.cpp: MXFP4, INT4, block FP8 dequantised on the vector units,
#      then the dense kernel) against megatron_slmoe.ops through the shared packed oracle, and its own
#      injected bugs. Skip with --no-emu.
#
# Any compile error, failed check or uncaught injected bug: non-zero exit.
#
#   bash .ci/compile_ascendc.sh [--no-emu]
# Environment: PYTHON (default: .venv/bin/python, else python, else python3), CXX, ASCEND_HOME_PATH,
# SLMOE_ASCEND_SOC, JOBS.
set -euo pipefail
cd "$(dirname "$0")/.."

run_emu=1
for arg in "$@"; do
    case "$arg" in
        --no-emu) run_emu=0 ;;
        *) echo "usage: $0 [--no-emu]" >&2; exit 2 ;;
    esac
done

SECONDS=0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Step 1.
cann=""
for sub in compiler/tikcpp/ascendc_kernel_cmake tools/tikcpp/ascendc_kernel_cmake ascendc_devkit/tikcpp/samples/cmake; do
    if [ -z "$cann" ] && [ -n "${ASCEND_HOME_PATH:-}" ] && [ -f "$ASCEND_HOME_PATH/$sub/ascendc.cmake" ]; then
        cann=$ASCEND_HOME_PATH
    fi
done
if [ -z "$cann" ]; then
    echo "compile_ascendc: skipped the CANN build, no CANN (ASCEND_HOME_PATH with ascendc_kernel_cmake)"
else
    cmake -S csrc/ascendc -B "$tmp/cann" -DSOC_VERSION="${SLMOE_ASCEND_SOC:-Ascend910B1}" >/dev/null
    cmake --build "$tmp/cann" --parallel "${JOBS:-2}"
    echo "compile_ascendc: ok  csrc/ascendc kernels with CANN's toolchain (${SLMOE_ASCEND_SOC:-Ascend910B1}) [${SECONDS}s]"
fi

# Step 2.
python=${PYTHON:-}
if [ -z "$python" ] && [ -x .venv/bin/python ]; then python=.venv/bin/python; fi  # scripts/test.sh's venv
if [ -z "$python" ]; then python=$(command -v python || command -v python3 || true); fi
torch_includes=""
if [ -n "$python" ]; then
    torch_includes=$("$python" -c 'from torch.utils.cpp_extension import include_paths; print(" ".join(include_paths()))' 2>/dev/null || true)
fi
torch_npu_include=""
if [ -n "$torch_includes" ]; then
    torch_npu_include=$("$python" -c 'import importlib.util as u, os; s = u.find_spec("torch_npu"); print(os.path.join(list(s.submodule_search_locations)[0], "include") if s else "")' 2>/dev/null || true)
fi
if [ -z "$torch_includes" ]; then
    echo "compile_ascendc: skipped the binding check, no Python with torch"
elif { [ -n "$cann" ] && [ -n "$torch_npu_include" ]; } || [ "$run_emu" = 0 ]; then
    flags=(-std=c++20 -fsyntax-only -Wall -Wextra -Werror -Icsrc)
    if [ -n "$cann" ] && [ -n "$torch_npu_include" ]; then
        flags+=(-isystem "$torch_npu_include" -isystem "$cann/include")
        against="torch, torch_npu and CANN headers"
    else
        flags+=(-Icsrc/ascendc/emu/stubs)
        against="torch headers, stand-ins for torch_npu / ACL"
    fi
    for inc in $torch_includes; do flags+=(-isystem "$inc"); done
    "${CXX:-g++}" "${flags[@]}" csrc/ascendc/lora_expert_npu.cpp
    echo "compile_ascendc: ok  csrc/ascendc/lora_expert_npu.cpp (host compiler, $against) [${SECONDS}s]"
fi

# Step 3.
if [ "$run_emu" = 1 ]; then
    if [ -n "$torch_includes" ]; then
        export SLMOE_TORCH_INCLUDES="$torch_includes"
        SLMOE_TORCH_LIBDIR=$("$python" -c 'from torch.utils.cpp_extension import library_paths; print(library_paths()[0])')
        SLMOE_TORCH_CXX11_ABI=$("$python" -c 'import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))')
        export SLMOE_TORCH_LIBDIR SLMOE_TORCH_CXX11_ABI
        export SLMOE_EMU_PYTHON=$python
    else
        unset SLMOE_EMU_PYTHON
    fi
    if ! out=$(bash csrc/ascendc/emu/run.sh --quick 2>&1); then
        echo "$out"
        echo "compile_ascendc: FAILED, see the emulation's output above (csrc/ascendc/emu)" >&2
        exit 1
    fi
    echo "$out" | sed -n '/worst error vs fp64/,/cases passed/p'
    echo "compile_ascendc: ok  $(echo "$out" | grep -m1 '^tiling_test:')"
    echo "compile_ascendc: ok  $(echo "$out" | grep -m1 '^api_selftest:')"
    if [ -n "$torch_includes" ]; then echo "compile_ascendc: ok  $(echo "$out" | grep -m1 '^npu_binding_test:')"; fi
    echo "compile_ascendc: ok  emulated kernel: $(echo "$out" | grep -m1 'cases passed'); $(echo "$out" | grep -m1 '^injected bugs caught:') [${SECONDS}s]"
    if [ -n "$torch_includes" ]; then
        echo "compile_ascendc: ok  emulated packed path vs megatron_slmoe.ops: $(echo "$out" | grep -m1 '^packed oracle:'); $(echo "$out" | grep -m1 '^packed injected bugs caught:')"
    else
        echo "compile_ascendc: skipped the packed path's oracle, no Python with torch"
    fi
fi
echo "compile_ascendc: passed in ${SECONDS}s"
