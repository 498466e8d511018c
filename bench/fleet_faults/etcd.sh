#!/bin/bash
# etcd.sh [DATA_DIR]: start a one-member etcd on 127.0.0.1:23381 (peer 23382); data dir default $FLEET_FAULTS_RUN/etcd-data;
# log $FLEET_FAULTS_RUN/logs/etcd.log, pid in $FLEET_FAULTS_RUN/etcd.pid (also appended to $FLEET_FAULTS_RUN/pids). Prints the pid.
RUN=${FLEET_FAULTS_RUN:-${TMPDIR:-/tmp}/snowgate-fleet-faults}; mkdir -p "$RUN/logs"
D=${1:-$RUN/etcd-data}
nohup etcd --name default --data-dir "$D" --listen-client-urls http://127.0.0.1:23381 --advertise-client-urls http://127.0.0.1:23381 \
  --listen-peer-urls http://127.0.0.1:23382 --initial-advertise-peer-urls http://127.0.0.1:23382 \
  --initial-cluster default=http://127.0.0.1:23382 >> "$RUN/logs/etcd.log" 2>&1 &
echo $! > "$RUN/etcd.pid"; echo $! >> "$RUN/pids"
echo $!
