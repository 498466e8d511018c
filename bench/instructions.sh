#!/usr/bin/env bash
# Instructions per call of each plugin path, counted by callgrind: the
# repeatable counterpart of `plugin_path`'s times (see
# host/benches/instructions.rs). Each path runs twice, N and 2N
# iterations; the difference over N is one iteration, without set-up.
#
#   cargo bench -p snowgate-host --bench instructions --no-run
#   bench/instructions.sh target/release/deps/instructions-<hash> [MORE_BINARIES...]
#
# With several binaries (builds of different commits, copied aside), each
# row has a column per binary. Environment: N (2000), PATHS
# ('native plugin_reused floor_echo'), CASES ('chat_1KiB chat_64KiB').
# Needs valgrind (Debian's package).
set -euo pipefail
if [ $# -lt 1 ]; then
    echo "usage: $0 INSTRUCTIONS_BINARY [MORE_BINARIES...]" >&2
    exit 2
fi
command -v valgrind >/dev/null || { echo "$0: needs valgrind (apt-get install valgrind)" >&2; exit 2; }
n=${N:-2000}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# Only inside the bench's `counted_*` loops, on the thread that runs them:
# not the plugin's compilation on wasmtime's parallel threads (about 2
# billion instructions a run, whose variation moved the per-call count by
# hundreds either way: the echo floor read 7,485 to 8,451 for one build),
# and not the epoch ticker thread.
count() { # BINARY PATH CASE ITERATIONS -> total instructions
    valgrind --tool=callgrind --toggle-collect='instructions::counted_*' \
        --callgrind-out-file="$out/cg.out" "$1" "$2" "$3" "$4" \
        >"$out/log" 2>&1 || { cat "$out/log" >&2; exit 1; }
    total=$(sed -n 's/^summary: //p' "$out/cg.out")
    if [ "${total:-0}" -eq 0 ]; then
        echo "$0: $1 counted nothing: it has no instructions::counted_* loops, so it was built from a host/benches/instructions.rs older than this script; build it with this one" >&2
        exit 1
    fi
    echo "$total"
}
printf '%-14s %-12s' case path
for binary in "$@"; do printf ' %16s' "$(basename "$binary" | cut -c1-16)"; done
printf '   (instructions per call, N=%s)\n' "$n"
for case in ${CASES:-chat_1KiB chat_64KiB}; do
    for path in ${PATHS:-native plugin_reused floor_echo}; do
        printf '%-14s %-12s' "$case" "$path"
        for binary in "$@"; do
            one=$(count "$binary" "$path" "$case" "$n")
            two=$(count "$binary" "$path" "$case" $((2 * n)))
            printf ' %16s' $(((two - one) / n))
        done
        printf '\n'
    done
done
