#!/usr/bin/env bash
# Instructions per proxied request of the whole gateway, counted by
# callgrind: the repeatable counterpart of bench/cpu_split.sh's CPU times,
# for comparing builds of the gateway's own code (hyper, tokio, the
# middleware, wasmtime's host side) side by side.
#
#   cargo build --release        # at each commit; copy target/release/snowgate aside
#   bench/gateway_instructions.sh SNOWGATE [MORE_SNOWGATES...]
#
# For each binary and each content type it starts nginx answering
# `return 200` as the upstream and the gateway under callgrind (one worker
# thread, 8 plugin instance slots: valgrind cannot reserve the address
# space of the default 64; plugins compiled in its own process, since under
# valgrind `/proc/self/exe` is valgrind and no compile process starts), warms it up with 200 requests, zeroes the
# counters, sends N more of bench/load.py's 1 KiB chat request (oha, 4
# connections), and prints the instructions counted in user space in the
# gateway process (every thread) divided by N. `application/json` goes
# through the plugin; `text/plain`, the same bytes, streams through without
# it. The kernel's share (about half the CPU, see BENCHMARKS.md) is not
# counted. Environment: N (2000), CTYPES ('application/json text/plain'),
# HEADER (one more request header, e.g. 'Connection: keep-alive', as
# Python's requests and httpx send).
# Needs valgrind, nginx, oha (on PATH or in /opt/oha/bin), curl, python3.
set -euo pipefail
if [ $# -lt 1 ]; then
    echo "usage: $0 SNOWGATE [MORE_SNOWGATES...]" >&2
    exit 2
fi
PATH=$PATH:/opt/oha/bin
for tool in valgrind callgrind_control nginx oha curl python3; do
    command -v "$tool" >/dev/null || { echo "$0: needs $tool" >&2; exit 2; }
done
N=${N:-2000}
HERE=$(cd "$(dirname "$0")" && pwd)
DIR=$(mktemp -d)
SG=
trap 'kill $(cat "$DIR/nginx.pid" 2>/dev/null) 2>/dev/null || true; [ -n "$SG" ] && kill "$SG" 2>/dev/null; rm -rf "$DIR"' EXIT
# Ctrl-C ends the run, and the trap above stops the daemonized nginx. Without
# this, bash went on when the snowgate under valgrind ended cleanly on the
# same SIGINT, and once exited without running the trap.
trap 'exit 130' INT TERM
. "$HERE/upstream.sh"
UP=$(free_port)

write_body "$DIR" 1KiB
start_upstream "$DIR" "$UP"

send() { # PORT CTYPE COUNT: COUNT requests, all of which must be answered 200
    local out
    out=$(oha -n "$3" -c 4 --no-tui -m POST -H "Content-Type: $2" ${HEADER:+-H "$HEADER"} -D "$DIR/body.json" \
        "http://127.0.0.1:$1/v1/chat/completions")
    grep -q "\[200\] $3 responses" <<<"$out" || { echo "$0: not every request got 200:" >&2; echo "$out" >&2; exit 1; }
}

count() ( # BINARY CTYPE -> instructions per request
    # A subshell with a trap of its own: it runs in $(...), where the EXIT
    # trap above does not run and does not see this SG, so on a failure it
    # stops its own snowgate before the trap above deletes $DIR.
    local port admin
    port=$(free_port); admin=$(free_port)
    rm -f "$DIR"/cg.out*
    valgrind --tool=callgrind --callgrind-out-file="$DIR/cg.out" --dump-instr=no \
        "$1" serve --listen "127.0.0.1:$port" --admin-listen "127.0.0.1:$admin" \
        --upstream "http://127.0.0.1:$UP" --machine-id 1 --workers 1 --plugin-instances 8 \
        --plugin-compile-in-process > "$DIR/snowgate.log" 2>&1 &
    SG=$!
    trap '[ -z "$SG" ] || { kill "$SG" 2>/dev/null; wait "$SG" 2>/dev/null; } || true' EXIT
    for _ in $(seq 600); do curl -sf -o /dev/null "127.0.0.1:$admin/readyz" && break; sleep 0.2; done
    curl -sf -o /dev/null "127.0.0.1:$admin/readyz" || { cat "$DIR/snowgate.log" >&2; exit 1; }
    send "$port" "$2" 200
    callgrind_control -z "$SG" >/dev/null 2>&1
    send "$port" "$2" "$N"
    # The dump is written as cg.out.1 once callgrind has handled the request.
    callgrind_control -d "$SG" >/dev/null 2>&1
    kill "$SG"; wait "$SG" || true; SG=
    local total
    total=$(sed -n 's/^summary: //p' "$DIR/cg.out.1")
    echo $((total / N))
)

printf '%-18s' "content type"
for binary in "$@"; do printf ' %16s' "$(basename "$binary" | cut -c1-16)"; done
printf '   (instructions per request in the gateway, N=%s)\n' "$N"
for ctype in ${CTYPES:-application/json text/plain}; do
    printf '%-18s' "$ctype"
    for binary in "$@"; do
        # A failed count ends the run, not just its column.
        per_request=$(count "$binary" "$ctype") || exit 1
        printf ' %16s' "$per_request"
    done
    printf '\n'
done
