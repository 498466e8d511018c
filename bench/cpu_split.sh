#!/usr/bin/env bash
# Where one proxied request's CPU goes, plugin path against pass-through.
#
#   bench/cpu_split.sh [SNOWGATE] [ROUNDS]
#   SIZE=64KiB bench/cpu_split.sh ...   # bench/load.py's 64 KiB body instead
#
# Starts nginx answering `return 200` as the upstream and one snowgate with
# one worker thread (`--workers 1`), drives it with `wrk -t1 -c16` until that
# worker is the bottleneck, and samples it with `perf record` for 4 s, in
# turns: the 1 KiB chat request of bench/load.py (or the body SIZE names)
# as JSON (through the plugin) and the same bytes as text/plain (streamed
# through without it).
# For each run it prints the worker's CPU per request (perf's task-clock
# over the requests counted in /metrics) and how that splits between the
# kernel, snowgate's own code (hyper, tokio, wasmtime, the host), the
# plugin's compiled wasm ([JIT]) and libc. Needs nginx, wrk, perf, curl and
# python3; builds nothing (`cargo build --release` first).
set -euo pipefail
BIN=${1:-target/release/snowgate}
ROUNDS=${2:-3}
SIZE=${SIZE:-1KiB}
BIN=$(realpath "$BIN")
HERE=$(cd "$(dirname "$0")" && pwd)
DIR=$(mktemp -d)
trap 'kill $(cat "$DIR/nginx.pid" 2>/dev/null) 2>/dev/null || true; kill "${SG:-}" 2>/dev/null || true; rm -rf "$DIR"' EXIT
. "$HERE/upstream.sh"
UP=$(free_port); PORT=$(free_port); ADMIN=$(free_port)

write_body "$DIR" "$SIZE"
start_upstream "$DIR" "$UP"
cat > "$DIR/post.lua" <<'EOF'
local f = io.open(os.getenv("BODY"), "rb"); local body = f:read("*a"); f:close()
wrk.method = "POST"; wrk.body = body
wrk.headers["Content-Type"] = os.getenv("CTYPE")
EOF

requests() { curl -s "127.0.0.1:$ADMIN/metrics" | awk '/^snowgate_requests_total/ {s += $2} END {print s}'; }

one_run() { # $1: content type
    "$BIN" serve --listen "127.0.0.1:$PORT" --admin-listen "127.0.0.1:$ADMIN" \
        --upstream "http://127.0.0.1:$UP" --machine-id 1 --workers 1 > "$DIR/snowgate.log" 2>&1 &
    SG=$!
    for _ in $(seq 200); do curl -sf -o /dev/null "127.0.0.1:$ADMIN/readyz" && break; sleep 0.05; done
    export BODY="$DIR/body.json" CTYPE="$1"
    wrk -t1 -c16 -d7s -s "$DIR/post.lua" "http://127.0.0.1:$PORT/v1/chat/completions" > "$DIR/wrk.txt" &
    local wrk=$!
    # Past wrk's connection set-up and the first instances.
    sleep 2
    local before; before=$(requests)
    perf record -q -e task-clock -F 1999 -p "$SG" -o "$DIR/perf.data" -- sleep 4 > /dev/null 2>&1
    local after; after=$(requests)
    wait "$wrk"
    kill -TERM "$SG"; wait "$SG" || true
    perf report -i "$DIR/perf.data" --stdio --sort dso -g none 2> /dev/null > "$DIR/dso.txt"
    local ms; ms=$(perf script -i "$DIR/perf.data" -F period 2> /dev/null | awk '{s += $1} END {print s / 1e6}')
    python3 - "$1" "$((after - before))" "$ms" "$DIR/dso.txt" <<'PY'
import re, sys
ctype, n, ms, path = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
us = ms * 1000 / n
split = {}
for line in open(path):
    m = re.match(r"\s*([\d.]+)%\s+(.*\S)", line)
    if m:
        name = m.group(2)
        name = "[JIT]" if name.startswith("[JIT]") else name
        split[name] = split.get(name, 0) + float(m.group(1))
parts = ", ".join(f"{k} {v * us / 100:.1f}" for k, v in sorted(split.items(), key=lambda kv: -kv[1]))
print(f"{ctype:17s} {n:7d} requests  {us:5.1f} us CPU per request: {parts}")
PY
}

for _ in $(seq "$ROUNDS"); do
    one_run application/json
    one_run text/plain
done
