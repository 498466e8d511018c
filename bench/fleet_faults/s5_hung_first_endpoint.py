"""Scenario 5: a replica starts while the FIRST
of its three --etcd endpoints hangs (SIGSTOP); the other two have quorum.
Seconds until /readyz is 200, and which gateway log lines name the hung
endpoint's port (the harness's own '==== start' header line excluded).

usage: python3 s5_hung_first_endpoint.py [ttl] [give_up_secs] [linger_after_ready_secs]
"""
import os, re, signal, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fleetlib import *

ttl = int(sys.argv[1]) if len(sys.argv) > 1 else 120
give_up = int(sys.argv[2]) if len(sys.argv) > 2 else 150
linger = int(sys.argv[3]) if len(sys.argv) > 3 else 5

cluster = ",".join(f"m{k}=http://127.0.0.1:{23382 + 2 * k}" for k in range(3))
members = [Etcd(f"m{k}", 23381 + 2 * k, 23382 + 2 * k, cluster=cluster) for k in range(3)]
hung_port = str(members[0].client)
try:
    for m in members:
        m.wipe(); m.start(wait=False)
    for m in members:
        m.wait_up(30)
    members[0].sig(signal.SIGSTOP)
    log(f"SIGSTOP {members[0].name}; starting gw0 with --etcd {members[0].url},... ttl={ttl}")
    g = Gateway(0, ",".join(m.url for m in members), ttl).start()
    t0 = g.started_at
    ready_at, last_log = None, -99
    while time.time() - t0 < give_up:
        s, b = g.ready()
        if s == 200:
            ready_at = time.time() - t0
            break
        if time.time() - last_log >= 2:
            last_log = time.time()
            st = g.status() or {}
            log(f"t+{time.time() - t0:5.1f}s readyz={s} {b.strip()[:60]!r} lease={machine_of(st)} "
                f"last_error={str((st.get('lease') or {}).get('last_error'))[:140]!r}")
        time.sleep(0.1)
    log(f"ready after {fmt(ready_at)} s (give up at {give_up} s); lingering {linger} s")
    time.sleep(linger)
    st = g.status() or {}
    log(f"status at end: lease={machine_of(st)} last_error={str((st.get('lease') or {}).get('last_error'))[:200]!r}")
    g.stop()
    own = open(g.logpath, errors="replace").read().split("==== start")[-1].splitlines()[1:]  # this run's lines only
    lines = [l for l in own if hung_port in l]
    log(f"gateway log lines naming port {hung_port}: {len(lines)}")
    for l in lines[:20]:
        print("   ", l[:400])
    # first lease log line: when the keeper first got an answer from etcd
    first = None
    for l in own:
        if "holding machine id" in l or "acquired" in l.lower():
            first = l.strip()[:200]; break
    log(f"first lease line: {first}")
    log(f"SUMMARY ttl={ttl}: ready after {fmt(ready_at)} s; log lines naming :{hung_port}: {len(lines)}")
    print(f"ROW| s5 hung first endpoint | {ttl} | {fmt(ready_at) if ready_at is not None else f'not ready in {give_up}'} | "
          f"{len(lines)} | {(lines[0][:110].replace('|', '/') if lines else '-')} |", flush=True)
finally:
    tear_down(members)
