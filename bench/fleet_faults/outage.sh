#!/bin/bash
# outage.sh DOWN_SECS TTL [data|wipe]: replicas r1,r2 of $SNOWGATE (--machine-id-ttl TTL, or default when TTL=default)
# ready on a fresh one-member etcd (127.0.0.1:23381); etcd killed -9 for DOWN_SECS, then restarted with its data (or wiped);
# outage_watch.py reports per replica: when it went unready, seconds from etcd back until /readyz 200, same machine/lease id.
# Everything under $FLEET_FAULTS_RUN (default ${TMPDIR:-/tmp}/snowgate-fleet-faults). Kills what it started on exit.
: "${SNOWGATE:?set SNOWGATE=/path/to/binary}"
S=$(dirname "$(readlink -f "$0")"); export FLEET_FAULTS_RUN=${FLEET_FAULTS_RUN:-$S/run}; RUN=$FLEET_FAULTS_RUN; mkdir -p "$RUN/logs"
DOWN=$1; TTL=$2; MODE=${3:-data}
ours(){ # pid pattern: is it alive and ours?
  [ -n "$1" ] && tr '\0' ' ' < /proc/$1/cmdline 2>/dev/null | grep -q -- "$2"; }
cleanup(){
  for n in 1 2; do p=$(cat "$RUN/r$n.pid" 2>/dev/null); ours "$p" "127.0.0.1:1909$n" && kill -TERM "$p"; done
  for i in $(seq 1 40); do a=0; for n in 1 2; do p=$(cat "$RUN/r$n.pid" 2>/dev/null); ours "$p" "127.0.0.1:1909$n" && a=1; done; [ $a = 0 ] && break; sleep 0.25; done
  for n in 1 2; do p=$(cat "$RUN/r$n.pid" 2>/dev/null); ours "$p" "127.0.0.1:1909$n" && kill -9 "$p"; rm -f "$RUN/r$n.pid"; done
  p=$(cat "$RUN/etcd.pid" 2>/dev/null); ours "$p" "$RUN/etcd-data" && kill -9 "$p"; rm -f "$RUN/etcd.pid"
  rm -rf "$RUN/etcd-data"
}
trap cleanup EXIT; trap 'exit 143' TERM INT HUP
cleanup
TTLARG=(); [ "$TTL" != default ] && TTLARG=(--machine-id-ttl "$TTL")
$S/etcd.sh >/dev/null
for i in $(seq 1 100); do curl -sf -m 1 127.0.0.1:23381/health | grep -q true && break; sleep 0.1; done
$S/replica.sh 1 "${TTLARG[@]}" >/dev/null; $S/replica.sh 2 "${TTLARG[@]}" >/dev/null
T=$SECONDS
until curl -sf -m 1 127.0.0.1:19091/readyz >/dev/null && curl -sf -m 1 127.0.0.1:19092/readyz >/dev/null; do
  [ $((SECONDS - T)) -gt 90 ] && { echo "replicas not ready after 90 s"; tail -5 "$RUN"/logs/r?.log; exit 1; }; sleep 0.2; done
echo "$(date +%T) both ready after $((SECONDS - T)) s (ttl $TTL)"
python3 $S/outage_watch.py "$DOWN" "$TTL" "$MODE" 120
echo "etcd keys after:"; timeout 10 $S/etcdkv.py get /snowgate
