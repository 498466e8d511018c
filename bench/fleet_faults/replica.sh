#!/bin/bash
# replica.sh N [extra args...]: start replica N (1..9) of $SNOWGATE on 127.0.0.1:1808N, admin 1909N, --etcd 127.0.0.1:23381;
# log $FLEET_FAULTS_RUN/logs/rN.log, pid in $FLEET_FAULTS_RUN/rN.pid (also appended to $FLEET_FAULTS_RUN/pids). Prints the pid.
: "${SNOWGATE:?set SNOWGATE=/path/to/binary}"
RUN=${FLEET_FAULTS_RUN:-${TMPDIR:-/tmp}/snowgate-fleet-faults}; mkdir -p "$RUN/logs"
N=$1; shift
echo "==== start $(date +%T) $SNOWGATE $*" >> "$RUN/logs/r$N.log"
SNOWGATE_LOG=${SNOWGATE_LOG:-info} nohup ${PREFIXCMD:-} "$SNOWGATE" serve --listen 127.0.0.1:1808$N --admin-listen 127.0.0.1:1909$N \
  --etcd http://127.0.0.1:23381 --workers 1 --plugin-instances 8 --shutdown-grace-secs 5 "$@" >> "$RUN/logs/r$N.log" 2>&1 &
echo $! > "$RUN/r$N.pid"; echo $! >> "$RUN/pids"
echo $!
