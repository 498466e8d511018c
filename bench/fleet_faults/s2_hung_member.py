"""Scenario 2: the etcd member the replica talks
to (m0, its first endpoint) hangs (SIGSTOP) while the replica holds a machine
id; m1, m2 keep quorum. Counts 200 vs 503 of context-only requests during the
hang and the longest stretch without a 200.

usage: python3 s2_hung_member.py [ttl] [observe_secs]
"""
import os, signal, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fleetlib import *

ttl = int(sys.argv[1]) if len(sys.argv) > 1 else 60
observe = int(sys.argv[2]) if len(sys.argv) > 2 else 60

cluster = ",".join(f"m{k}=http://127.0.0.1:{23382 + 2 * k}" for k in range(3))
members = [Etcd(f"m{k}", 23381 + 2 * k, 23382 + 2 * k, cluster=cluster) for k in range(3)]
try:
    for m in members:
        m.wipe(); m.start(wait=False)
    for m in members:
        m.wait_up(30)
    g = Gateway(0, ",".join(m.url for m in members), ttl).start()
    w = g.wait_ready(60)
    log(f"gw0 ready after {w:.1f}s: {machine_of(g.status())}")
    pr = Prober(g).start()
    time.sleep(4)
    victim = members[0]
    t0 = time.time()
    log(f"SIGSTOP etcd member {victim.name} ({victim.url})")
    victim.sig(signal.SIGSTOP)
    unready = watch_seconds(g, pr, observe, t0)
    t1 = time.time()
    pr.stop()
    summarize("s2 hung member", "hung", ttl, observe, pr, t0, t1, unready)
    victim.sig(signal.SIGCONT)
    g.stop()
finally:
    tear_down(members)
