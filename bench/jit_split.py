#!/usr/bin/env python3
"""Splits a callgrind profile's instructions in a plugin's compiled code by wasm function.

callgrind does not know the names of the code wasmtime compiles, but the engine writes them
to /tmp/perf-PID.map when SNOWGATE_WASM_PERFMAP=1, and under valgrind the program's PID is the
one callgrind names its output after:

    cargo bench -p snowgate-host --bench instructions --no-run
    SNOWGATE_WASM_PERFMAP=1 valgrind --tool=callgrind --dump-instr=yes --dump-line=no \\
        --callgrind-out-file=cg.out target/release/deps/instructions-<hash> plugin_reused chat_1KiB 2000
    python3 bench/jit_split.py cg.out /tmp/perf-PID.map 2001

The last argument is the number of calls made (the instructions bench makes ITERATIONS + 1),
to print instructions per call. Exclusive counts: a function's callees are counted apart.
"""
import bisect
import collections
import sys


def main() -> None:
    if len(sys.argv) != 4:
        sys.exit("usage: jit_split.py CALLGRIND_OUT PERF_MAP CALLS")
    out, perf_map, calls = sys.argv[1], sys.argv[2], int(sys.argv[3])
    symbols = []
    for line in open(perf_map):
        start, size, name = line.rstrip("\n").split(" ", 2)
        symbols.append((int(start, 16), int(size, 16), name))
    if not symbols:
        sys.exit(f"{perf_map} names no functions: was SNOWGATE_WASM_PERFMAP=1 set?")
    symbols.sort()
    starts = [s[0] for s in symbols]
    low, high = symbols[0][0], symbols[-1][0] + symbols[-1][1]
    cost = collections.Counter()
    total = 0
    position = 0
    call_line = False
    # With --dump-instr=yes --dump-line=no each cost line is "ADDRESS COST": an absolute
    # 0x address, +N or -N from the last one, or * for the same. The line after a calls=
    # line is the call's inclusive cost, already counted in the callee.
    for line in open(out):
        if not line or line[0] not in "0123456789+-*":
            call_line = call_line or line.startswith("calls=")
            continue
        fields = line.split()
        where = fields[0]
        if where.startswith("0x"):
            position = int(where, 16)
        elif where[0] == "+":
            position += int(where[1:])
        elif where[0] == "-":
            position -= int(where[1:])
        if call_line:
            call_line = False
            continue
        if len(fields) < 2:
            continue
        instructions = int(fields[1])
        total += instructions
        if low <= position < high:
            i = bisect.bisect_right(starts, position) - 1
            start, size, name = symbols[i]
            cost[name if position < start + size else "(between functions)"] += instructions
    compiled = sum(cost.values())
    print(f"the plugin's compiled code: {compiled / calls:,.0f} instructions per call "
          f"(the whole run, set-up and compilation included: {total / calls:,.0f})")
    for name, instructions in cost.most_common(25):
        print(f"{instructions / calls:10,.0f}  {name[:120]}")


if __name__ == "__main__":
    main()
