#!/bin/bash
# measure.sh BIN OUTDIR: etcd lease-keeper availability scenarios for one snowgate binary, run one after another.
#   OUTDIR/<name>.txt   full output of each scenario      OUTDIR/summary.md  the tables
#   OUTDIR/logs/<name>/ gateway and etcd logs of each scenario
# Ports: etcd 23381-23386, gateways 18080-18082 / admin 19090-19092. Needs root (s8: loop mount + fsfreeze).
# Every process started is recorded in OUTDIR/logs/<name>/pids; whatever is left is killed after each scenario
# (only if its command line is still ours), frozen mounts thawed and unmounted. Each scenario has a hard timeout.
set -u
[ $# -eq 2 ] || { echo "usage: $0 BIN OUTDIR"; exit 2; }
BIN=$(readlink -f "$1"); OUT=$(mkdir -p "$2" && cd "$2" && pwd)
[ -x "$BIN" ] || { echo "not executable: $BIN"; exit 2; }
[ "$(id -u)" = 0 ] || { echo "needs root (s8 uses mount -o loop and fsfreeze)"; exit 2; }
S=$(dirname "$(readlink -f "$0")")
export SNOWGATE=$BIN
unset SNOWGATE_LOG   # default log level of the binary (info)
CUR=""

backstop(){ # $1: run dir of a scenario
  local run=$1 p
  [ -n "$run" ] || return 0
  # thaw and unmount a frozen/mounted loop fs of ours first (processes blocked on it cannot die before)
  if mountpoint -q "$run/m0-mnt" 2>/dev/null; then
    fsfreeze -u "$run/m0-mnt" 2>/dev/null
  fi
  if [ -f "$run/pids" ]; then
    for p in $(sort -u "$run/pids"); do
      if tr '\0' ' ' < /proc/$p/cmdline 2>/dev/null | grep -q -e "$run" -e "$BIN"; then
        echo "backstop: killing leftover pid $p: $(tr '\0' ' ' < /proc/$p/cmdline | cut -c1-120)"
        kill -CONT "$p" 2>/dev/null; kill -9 "$p" 2>/dev/null
      fi
    done
    sleep 1
  fi
  if mountpoint -q "$run/m0-mnt" 2>/dev/null; then
    timeout 30 umount "$run/m0-mnt" || timeout 30 umount -l "$run/m0-mnt"
  fi
  rm -rf "$run"/etcd-* "$run/etcd-data" "$run/m0-disk.img" 2>/dev/null
}
trap 'backstop "$CUR"' EXIT
trap 'exit 143' TERM INT HUP

port_busy(){ ss -Hltn | awk '{print $4}' | grep -Eq ':(2338[1-6]|1808[0-2]|1909[0-2])$'; }

run(){ # name limit_secs cmd...
  local name=$1 limit=$2; shift 2
  CUR=$OUT/logs/$name; rm -rf "$CUR"; mkdir -p "$CUR"; export FLEET_FAULTS_RUN=$CUR
  for i in $(seq 1 20); do port_busy || break; sleep 1; done
  port_busy && echo "WARNING: a port of ours is still in use: $(ss -Hltnp | grep -E ':(2338[1-6]|1808[0-2]|1909[0-2]) ')" | tee -a "$OUT/$name.txt"
  echo "$(date +%T) == $name: $* (limit ${limit}s)"
  { echo "# $name: $* ; SNOWGATE=$BIN ; started $(date -Is)"; } > "$OUT/$name.txt"
  timeout -k 30 "$limit" "$@" >> "$OUT/$name.txt" 2>&1; local rc=$?
  echo "# exit code $rc$([ $rc = 124 ] && echo ' (TIMED OUT)')" >> "$OUT/$name.txt"
  backstop "$CUR" >> "$OUT/$name.txt" 2>&1
  CUR=""
  grep -E '^(SUMMARY|.* SUMMARY)' "$OUT/$name.txt" | sed 's/^/    /'
  [ $rc = 0 ] || echo "    !! $name exit code $rc (see $OUT/$name.txt)"
}

T0=$SECONDS
run outage_ttl3_down10   180 "$S/outage.sh" 10 3
run outage_ttl10_down20  200 "$S/outage.sh" 20 default
run s8_stalled_disk_ttl10 240 python3 -u "$S/s8_stalled_disk_follower.py" 60
run s5_hung_first_ttl120 240 python3 -u "$S/s5_hung_first_endpoint.py" 120 150 5
run s2_hung_member_ttl60  180 python3 -u "$S/s2_hung_member.py" 60 60
run s2_hung_member_ttl240 180 python3 -u "$S/s2_hung_member.py" 240 60

rows(){ grep -h '^ROW|' "$@" 2>/dev/null | sed 's/^ROW|/|/'; }
{
  echo "# snowgate etcd lease keeper availability: $BIN"
  echo
  echo "sha256 $(sha256sum "$BIN" | cut -c1-16)…, run $(date -Is), $((SECONDS - T0)) s. Full outputs: $OUT/<name>.txt; logs: $OUT/logs/."
  echo
  echo "## 1. etcd killed -9, restarted with its data (two replicas, one-member etcd)"
  echo
  echo "| scenario | TTL | down (s) | replica | unready after kill (s) | ready after etcd back (s) | machine_id before → after | same id | lease_id before → after | same lease |"
  echo "|---|---|---|---|---|---|---|---|---|---|"
  rows "$OUT"/outage_ttl3_down10.txt "$OUT"/outage_ttl10_down20.txt
  echo
  echo "## 2/4. faults under load (one context-only request at a time, 50 ms apart); times in s from the fault"
  echo
  echo "| scenario | TTL | observed (s) | 200 | 503 | other/exc | first non-200 | last non-200 | longest without a 200 (+ = still at end) | /readyz non-200 samples |"
  echo "|---|---|---|---|---|---|---|---|---|---|"
  rows "$OUT"/s8_stalled_disk_ttl10.txt "$OUT"/s2_hung_member_ttl60.txt "$OUT"/s2_hung_member_ttl240.txt
  echo
  echo "## 3. start with the first of three endpoints hung (SIGSTOP), port 23381"
  echo
  echo "| scenario | TTL | ready after start (s) | gateway log lines naming :23381 | first such line |"
  echo "|---|---|---|---|---|"
  rows "$OUT"/s5_hung_first_ttl120.txt
  echo
  for f in "$OUT"/*.txt; do grep -q '^# exit code [^0]' "$f" && echo "**$(basename "$f") ended with $(grep '^# exit code' "$f")**"; done
} > "$OUT/summary.md"
echo "$(date +%T) done in $((SECONDS - T0)) s: $OUT/summary.md"
cat "$OUT/summary.md"
