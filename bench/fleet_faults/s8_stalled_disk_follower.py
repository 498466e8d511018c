"""Scenario 8: the etcd member the replica talks
to first (m0) is a FOLLOWER whose disk stalls (data dir on an ext4 loop mount,
`fsfreeze -f`). Leader and the third member are healthy. Counts 200 vs 503 of
context-only requests during the freeze and the longest stretch without a 200.

Needs root. Cleans up: thaws, kills, unmounts (measure.sh has a backstop too).
usage: python3 s8_stalled_disk_follower.py [observe_secs] [ttl]
"""
import os, subprocess, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fleetlib import *

observe = int(sys.argv[1]) if len(sys.argv) > 1 else 60
ttl = int(sys.argv[2]) if len(sys.argv) > 2 else 10
IMG, MNT = f"{DIR}/m0-disk.img", f"{DIR}/m0-mnt"


def sh(*cmd, timeout=60):
    return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=timeout).stdout


cluster = ",".join(f"m{k}=http://127.0.0.1:{23382 + 2 * k}" for k in range(3))
members = [Etcd(f"m{k}", 23381 + 2 * k, 23382 + 2 * k, cluster=cluster,
                data=(f"{MNT}/data" if k == 0 else None)) for k in range(3)]
frozen = mounted = False
ttl_s = f"{ttl}" + (" (default)" if len(sys.argv) <= 2 else "")
try:
    os.makedirs(MNT, exist_ok=True)
    sh("dd", "if=/dev/zero", f"of={IMG}", "bs=1M", "count=200", "status=none")
    sh("mkfs.ext4", "-q", "-F", IMG)
    sh("mount", "-o", "loop", IMG, MNT); mounted = True
    for m in members:
        m.wipe(); m.start(wait=False)
    for m in members:
        m.wait_up(30)
    ids = leader = None
    for attempt in range(5):
        st = [m.call("/v3/maintenance/status", {}) for m in members]
        ids = [s["header"]["member_id"] for s in st]
        leader = st[1]["leader"]
        if leader != ids[0] and leader != "0":
            break
        if leader == ids[0]:
            try:
                members[0].call("/v3/maintenance/transfer-leadership", {"targetID": ids[1]}, timeout=10)
            except Exception as e:
                log(f"transfer-leadership: {e}")
        time.sleep(2)
    log(f"members {ids}, leader {leader}")
    assert leader != ids[0], "m0 must be a follower"

    g = Gateway(0, ",".join(m.url for m in members), ttl if len(sys.argv) > 2 else None).start()
    w = g.wait_ready(60)
    log(f"gw0 ready after {w:.1f}s: {machine_of(g.status())} (ttl {ttl_s})")

    pr = Prober(g).start()
    time.sleep(3)
    sh("fsfreeze", "-f", MNT, timeout=20); frozen = True
    t0 = time.time()
    log(f"fsfreeze -f {MNT}: m0's disk stalls")
    try:
        kv_put(members[1], "/probe", "ok")
        log("a write through m1 succeeded while m0 is stalled")
    except Exception as e:
        log(f"a write through m1 FAILED: {e}")
    unready = watch_seconds(g, pr, observe, t0)
    t1 = time.time()
    sh("fsfreeze", "-u", MNT, timeout=20); frozen = False
    log("fsfreeze -u: m0's disk works again")
    for k in range(8):
        time.sleep(1)
        c = pr.second(int(time.time()) - 1)
        log(f"after thaw t+{time.time() - t1:4.1f}s 200={c.get(200, 0):3d} 503={c.get(503, 0):3d} readyz={g.ready()[0]}")
    pr.stop()
    summarize("s8 stalled-disk follower", "frozen", ttl_s, observe, pr, t0, t1, unready)
    g.stop()
finally:
    if frozen:
        subprocess.run(["fsfreeze", "-u", MNT], timeout=20)
    cleanup()
    time.sleep(1)
    if mounted:
        subprocess.run(["umount", MNT], timeout=30)
    subprocess.run(["rm", "-f", IMG])
    for m in members[1:]:
        m.wipe()
