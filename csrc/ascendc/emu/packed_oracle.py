"""The emulated AscendC packed path (packed_decode_kernel.cpp + packed_tiling.cpp) against the pure-torch oracle.

Run by csrc/ascendc/emu/run.sh with the emulation built as a shared library (packed_shim.cpp, the C
entry points of csrc/cuda/emu/packed_shim.cpp), through the CUDA emulator's oracle, shared rather
than copied (csrc/cuda/emu/packed_oracle.py: its cases, its three checks: the decode equals
``PackedWeight.decode`` bit for bit; y, h, dx, dA, dB of the packed launches equal, bit for bit,
the dense launches' on the decoded weight, in chunks of one expert and of all; the dense results
within the dtype's tolerance of ``ops.lora_grouped_linear_reference`` in float64):

    python csrc/ascendc/emu/packed_oracle.py LIBRARY [--no-mutants]

Then every injected bug of the AscendC packed path (SLMOE_MUTANT(n), n >= 31) must be caught, each
in a forked child: by a check, or by the emulation (exit status 3: a race, an API misuse).
Exit 1 on any failure or uncaught bug.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location(
    "slmoe_packed_oracle", os.path.join(HERE, "..", "..", "cuda", "emu", "packed_oracle.py"))
oracle = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(oracle)

MUTANTS = {
    31: "4-bit: nibbles of a word in reverse order",
    32: "4-bit: the two nibbles of a byte swapped",
    33: "MXFP4: E8M0 bias 128",
    34: "MXFP4: scale indexed per 16 inputs",
    35: "INT4: the stored q+8 taken as q",
    36: "INT4: groups of 32 whatever the group size",
    37: "INT4: q * scale not rounded to the scale's dtype",
    38: "FP8: block row index from the column block size",
    39: "FP8: subnormals decoded as normals",
    40: "segments: the last column segment of each row not decoded",
    41: "decode: experts with rows skipped, empty ones decoded",
    42: "missing PipeBarrier<PIPE_V> between the nibble shifts and the And",
    43: "chunks: every chunk's rows taken from row 0",
}


def run_checks(lib, all_cases, extremes, verbose):
    """Every check; the number of failures (a mutant run stops at the first)."""
    failures = 0
    for name, weight, dtype in extremes:
        try:
            oracle.check_decode(lib, name, weight, dtype)
            if verbose:
                print(f"ok   {name} (decode: every scale byte / FP8 code)")
        except oracle.CheckFailed as exc:
            failures += 1
            print(f"FAIL {exc}", flush=True)
            if not verbose:
                return failures
    for case in all_cases:
        try:
            oracle.check_decode(lib, case["name"], case["weight"], case["dtype"])
            oracle.check_case(lib, case, oracle=verbose)
            if verbose:
                print(f"ok   {case['name']} E={case['weight'].shape[0]} counts={case['counts']} "
                      f"chunks={case['chunks']}")
        except oracle.CheckFailed as exc:
            failures += 1
            print(f"FAIL {exc}", flush=True)
            if not verbose:
                return failures
    return failures


def run_mutant(lib, n, all_cases, extremes):
    """(caught, why) for mutant n, run in a forked child so that the emulation's exit on a race ends
    only the child."""
    read, write = os.pipe()
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:  # child: its stdout and stderr into the pipe
        os.close(read)
        os.dup2(write, 1)
        os.dup2(write, 2)
        lib.slmoe_emu_set_mutation(n)
        code = 1 if run_checks(lib, all_cases, extremes, verbose=False) else 0
        sys.stdout.flush()
        os._exit(code)
    os.close(write)
    with os.fdopen(read) as f:
        log = f.read()
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    lines = [line for line in log.splitlines() if line.startswith(("FAIL ", "emu: "))]
    return code != 0, (lines[0] if lines else f"exit status {code}")


def main(argv):
    if len(argv) < 2 or argv[1].startswith("-"):
        print(__doc__.strip().splitlines()[0])
        print("usage: packed_oracle.py LIBRARY [--no-mutants]")
        return 2
    oracle.torch.set_num_threads(1)  # forked children: no thread pool to inherit
    lib = oracle.load(argv[1])
    start = time.time()
    all_cases, extremes = oracle.cases(), oracle.extreme_decode_cases()
    total = len(all_cases) + len(extremes)
    failures = run_checks(lib, all_cases, extremes, verbose=True)
    print(f"packed oracle: {total - failures} of {total} cases passed [{time.time() - start:.0f}s]")
    if failures:
        return 1
    if "--no-mutants" in argv:
        return 0
    missed = []
    for n, what in MUTANTS.items():
        caught, why = run_mutant(lib, n, all_cases, extremes)
        if caught:
            print(f"mutant {n:2d} caught: {what}\n           by: {why[:150]}")
        else:
            missed.append(n)
            print(f"mutant {n:2d} NOT caught: {what}")
    print(f"packed injected bugs caught: {len(MUTANTS) - len(missed)} of {len(MUTANTS)} [{time.time() - start:.0f}s]")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
