#!/usr/bin/env bash
# Builds the AscendC kernel (../lora_expert_kernel.cpp) unchanged as host C++ against the emulation
# in this folder (g++ only, no CANN) and runs, in order:
#   1. tiling_test   the host planners' unit tests (../lora_tiling.cpp, ../packed_tiling.cpp);
#   2. api_selftest  the emulation against CANN's documented Mmad data flow (independent of the kernel);
#   3. emu_test      the emulated kernel against an fp64 reference (--quick: fewer large cases);
#   4. npu_binding_test  (when SLMOE_TORCH_INCLUDES is set) the torch_npu binding on CPU tensors with the
#                    emulated kernels and stand-ins for its torch_npu / ACL calls: the dense ops against
#                    the ATen math, the packed ops against decode-then-dense;
#   5. mutants       (unless --no-mutants) every injected bug below, each of which must make
#                    emu_test fail; one that passes is reported and fails the run;
#   6. packed_oracle.py  (when SLMOE_EMU_PYTHON names a Python with torch) the packed-weight path
#                    (../packed_decode_kernel.cpp, ../packed_tiling.cpp), built into a shared library
#                    with packed_shim.cpp, against megatron_slmoe.ops' decode and reference through the
#                    CUDA emulator's oracle, then its own injected bugs (unless --no-mutants).
#
#   bash csrc/ascendc/emu/run.sh [--quick] [--no-mutants]
# Environment: CXX (default g++), JOBS (parallel compiles, default 2); for step 4 SLMOE_TORCH_INCLUDES
# (torch's include directories, space-separated), SLMOE_TORCH_LIBDIR, SLMOE_TORCH_CXX11_ABI (0/1);
# for step 6 SLMOE_EMU_PYTHON.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
src=$(cd "$here/.." && pwd)

quick=""
mutants=1
for arg in "$@"; do
    case "$arg" in
        --quick) quick="--quick" ;;
        --no-mutants) mutants=0 ;;
        *) echo "usage: $0 [--quick] [--no-mutants]" >&2; exit 2 ;;
    esac
done

# Injected bugs, compiled in through SLMOE_MUTANT(n) (include/slmoe_mutant.h) and chosen at run time
# with SLMOE_EMU_MUTATION=n. Keep in step with the SLMOE_MUTANT sites in ../lora_expert_kernel.cpp and
# ../lora_tiling.cpp.
mutant_names=(
    [1]="off-by-one row tail: the last row of every tile is dropped"
    [2]="K tail: the last K step reads a full baseK"
    [3]="CO1 queue with one buffer: a two-term tile needs two accumulators"
    [4]="scaling dropped: s (and every term factor) taken as 1"
    [5]="wrong group offset: the next expert's first row"
    [6]="mask used before DeQue"
    [7]="missing PipeBarrier<PIPE_V> between the mask Cast and the Mul reading it"
    [8]="vector units skip CrossCoreWaitFlag(tile ready)"
    [9]="cube unit skips CrossCoreWaitFlag(slot free) before reusing a workspace slot"
    [10]="both tiles in flight share workspace slot 0"
    [11]="Mmad with M = 1 (GEMV reads L0A as ND, not ZZ)"
    [12]="Fixpipe srcStride = baseM instead of the Mmad's aligned M"
    [13]="transposed A ([K, M]) loaded into L0A without the fractal transpose"
    [14]="dropout mask ignored"
    [15]="output cast with CAST_NONE (not a float -> bf16 mode on Atlas A2)"
    [16]="planner: tile wider than the L0C/L0B/L1 budgets"
    [17]="planner: epilogue chunk twice the UB budget"
    [18]="experts without rows: dA/dB zero tiles not written"
    [19]="missing PipeBarrier<PIPE_M> between small accumulating Mmads"
    [20]="two AI Cores run the same tile"
    [21]="workspace rows of nLen floats (not 32-byte multiples)"
    [22]="[K, N] B loaded into L0B without the fractal transpose"
    [23]="both vector units take the first half of the rows"
    [24]="cube unit leaves the last slot-free flags unconsumed"
)

CXX=${CXX:-g++}
jobs=${JOBS:-2}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# -fPIC: the same objects make the packed oracle's shared library.
flags=(-std=c++17 -O2 -fPIC -Wall -Wextra -Werror -DSLMOE_ASCEND_EMU -I"$here/include" -I"$src" -include slmoe_mutant.h)
sources=("$src/lora_expert_kernel.cpp" "$src/lora_tiling.cpp" "$here/ascendc_emu.cpp" "$here/emu_test.cpp"
         "$here/tiling_test.cpp" "$here/api_selftest.cpp" "$src/packed_tiling.cpp")
packed=0
if [ -n "${SLMOE_EMU_PYTHON:-}" ]; then
    packed=1
    sources+=("$here/packed_shim.cpp")
fi
binding=0
if [ -n "${SLMOE_TORCH_INCLUDES:-}" ]; then binding=1; fi
if [ "$packed" = 1 ] || [ "$binding" = 1 ]; then sources+=("$src/packed_decode_kernel.cpp"); fi
pids=()
compile() {  # in the background, at most $jobs at a time
    "$@" &
    pids+=($!)
    if [ ${#pids[@]} -ge "$jobs" ]; then wait "${pids[0]}"; pids=("${pids[@]:1}"); fi
}
if [ "$binding" = 1 ]; then  # the slowest compile (torch's headers) first
    torch_flags=(-std=c++20 -O1 -Wall -Wextra -Werror "-D_GLIBCXX_USE_CXX11_ABI=${SLMOE_TORCH_CXX11_ABI:-1}"
                 -I"$src/.." -I"$here/stubs")
    for inc in $SLMOE_TORCH_INCLUDES; do torch_flags+=(-isystem "$inc"); done
    compile "$CXX" "${torch_flags[@]}" -c "$here/npu_binding_test.cpp" -o "$out/npu_binding_test.o"
fi
for s in "${sources[@]}"; do
    compile "$CXX" "${flags[@]}" -x c++ -c "$s" -o "$out/$(basename "$s" .cpp).o"
done
for p in "${pids[@]}"; do wait "$p"; done
"$CXX" "$out/tiling_test.o" "$out/lora_tiling.o" "$out/packed_tiling.o" "$out/ascendc_emu.o" -o "$out/tiling_test"
"$CXX" "$out/api_selftest.o" "$out/ascendc_emu.o" -o "$out/api_selftest"
"$CXX" "$out/emu_test.o" "$out/lora_expert_kernel.o" "$out/lora_tiling.o" "$out/ascendc_emu.o" -o "$out/emu_test"

"$out/tiling_test"
"$out/api_selftest"
"$out/emu_test" $quick
if [ "$binding" = 1 ]; then
    "$CXX" "$out/npu_binding_test.o" "$out/lora_expert_kernel.o" "$out/lora_tiling.o" "$out/packed_decode_kernel.o" \
        "$out/packed_tiling.o" "$out/ascendc_emu.o" -L"$SLMOE_TORCH_LIBDIR" -Wl,-rpath,"$SLMOE_TORCH_LIBDIR" -ltorch -ltorch_cpu -lc10 -o "$out/npu_binding_test"
    "$out/npu_binding_test"
fi
if [ "$packed" = 1 ]; then
    "$CXX" -shared "$out/packed_decode_kernel.o" "$out/packed_tiling.o" "$out/packed_shim.o" \
        "$out/lora_expert_kernel.o" "$out/lora_tiling.o" "$out/ascendc_emu.o" -o "$out/libslmoe_ascend_emu.so"
    oracle_args=()
    if [ "$mutants" = 0 ]; then oracle_args+=(--no-mutants); fi
    "$SLMOE_EMU_PYTHON" "$here/packed_oracle.py" "$out/libslmoe_ascend_emu.so" "${oracle_args[@]}"
fi

if [ "$mutants" = 1 ]; then
    caught=0
    total=0
    missed=()
    for n in "${!mutant_names[@]}"; do
        total=$((total + 1))
        if log=$(SLMOE_EMU_MUTATION=$n timeout 120 "$out/emu_test" $quick 2>&1); then
            missed+=("$n")
            echo "mutant $n NOT caught: ${mutant_names[$n]}"
        else
            caught=$((caught + 1))
            why=$(echo "$log" | grep -m1 -E '^(emu: |FAIL )' || echo "$log" | tail -n 1)
            printf 'mutant %2d caught: %s\n           by: %s\n' "$n" "${mutant_names[$n]}" "$why"
        fi
    done
    echo "injected bugs caught: $caught of $total"
    if [ ${#missed[@]} -gt 0 ]; then
        echo "csrc/ascendc/emu: injected bugs not caught: ${missed[*]}" >&2
        exit 1
    fi
fi
