#!/usr/bin/env bash
# Runs two builds of a criterion bench binary in turns, round after round,
# and prints each benchmark's median estimate (in µs) per round: an A/B
# comparison side by side, so that both see the same machine load.
#
#   # the old build: at the old commit
#   cargo bench -p snowgate-host --bench plugin_path --no-run
#   cp target/release/deps/plugin_path-<hash> /tmp/plugin_path-old
#   # the new build: at the new commit, the same two commands, to /tmp/plugin_path-new
#   bench/criterion_ab.sh /tmp/plugin_path-old /tmp/plugin_path-new
#
# Environment: ROUNDS (3), SECS of measurement per benchmark (3), FILTER, a
# criterion regex of the benchmarks to run ('(native|plugin_reused)$').
set -euo pipefail
if [ $# -ne 2 ]; then
    echo "usage: $0 BENCH_BINARY_A BENCH_BINARY_B" >&2
    exit 2
fi
filter=${FILTER:-'(native|plugin_reused)$'}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for round in $(seq "${ROUNDS:-3}"); do
    for binary in "$1" "$2"; do
        # Each run in its own directory: criterion's saved baselines of one
        # build must not be compared with the other's.
        dir="$out/$(basename "$binary")"
        mkdir -p "$dir"
        (cd "$dir" && "$binary" --bench "$filter" --warm-up-time 1 \
            --measurement-time "${SECS:-3}" --noplot) 2>/dev/null |
            python3 -c '
import re, sys
round, build = sys.argv[1], sys.argv[2]
units = {"ns": 1e-3, "µs": 1.0, "us": 1.0, "ms": 1e3, "s": 1e6}
name = None
for line in sys.stdin:
    m = re.match(r"^(\S+/\S+)", line)
    if m:
        name = m.group(1)
    m = re.search(r"time:\s+\[\S+ \S+ (\S+) (\S+)", line)
    if m and name and "%" not in line:
        print(round, build, name, "%.3f" % (float(m.group(1)) * units[m.group(2)]), "µs")
' "$round" "$(basename "$binary")"
    done
done
