#!/usr/bin/env python3
"""outage_watch.py DOWN_SECS TTL_LABEL [MODE=data|wipe] [TIMEOUT]: with etcd ($FLEET_FAULTS_RUN/etcd.pid) and replicas 1,2 ready,
snapshot machine_id / lease.lease_id, kill -9 etcd, poll both replicas for DOWN_SECS, restart etcd (./etcd.sh, same
data dir unless wipe), poll until both /readyz are 200 (or TIMEOUT s), print per-replica results and ROW| lines."""
import http.client, json, os, subprocess, sys, time, urllib.request
S = os.path.dirname(os.path.abspath(__file__)); RUN = os.environ.get("FLEET_FAULTS_RUN", os.path.join(os.environ.get("TMPDIR", "/tmp"), "snowgate-fleet-faults"))
DOWN, TTL = float(sys.argv[1]), ("10 (default)" if sys.argv[2] == "default" else sys.argv[2])
MODE = sys.argv[3] if len(sys.argv) > 3 else "data"
TIMEOUT = float(sys.argv[4]) if len(sys.argv) > 4 else 90
R = (1, 2)

def get(port, path):
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=1); c.request("GET", path)
        r = c.getresponse(); return r.status, r.read().decode(errors="replace")
    except Exception as e:
        return None, str(e)

def snap(n):
    code, _ = get(19090 + n, "/readyz")
    s, b = get(19090 + n, "/status")
    try:
        d = json.loads(b); le = d.get("lease") or {}
        return dict(code=code, mid=d.get("machine_id"), lease=le.get("lease_id"), state=le.get("state"),
                    err=(le.get("last_error") or "")[:100])
    except Exception:
        return dict(code=code, mid=None, lease=None, state=None, err=b[:100])

def line(t, ss):
    return f"{time.strftime('%H:%M:%S')} {t:+6.1f}s " + " | ".join(
        f"r{n} {s['code']} {s['state']} mid={s['mid']} lease={s['lease']} {s['err']!r}" for n, s in zip(R, ss))

def etcd_healthy():
    try:
        with urllib.request.urlopen("http://127.0.0.1:23381/health", timeout=0.5) as r:
            return b"true" in r.read()
    except Exception:
        return False

before = {n: snap(n) for n in R}
print("before:", json.dumps(before), flush=True)
pid = int(open(f"{RUN}/etcd.pid").read())
tk = time.time(); os.kill(pid, 9)
print(f"{time.strftime('%H:%M:%S')} etcd (pid {pid}) killed -9; down for {DOWN}s", flush=True)
unready = {n: None for n in R}; last = 0
while time.time() - tk < DOWN:
    ss = [snap(n) for n in R]
    for n, s in zip(R, ss):
        if s["code"] != 200 and unready[n] is None:
            unready[n] = time.time() - tk
    if time.time() - last >= 1:
        last = time.time(); print(line(time.time() - tk, ss), flush=True)
    time.sleep(0.2)
if MODE == "wipe":
    subprocess.run(["rm", "-rf", f"{RUN}/etcd-data"])
tb = time.time()
subprocess.run([f"{S}/etcd.sh"], stdout=subprocess.DEVNULL)
print(f"{time.strftime('%H:%M:%S')} etcd back ({MODE}); times below are from this moment", flush=True)
healthy = None; ready = {n: None for n in R}; after = {}; last = 0
while time.time() - tb < TIMEOUT and None in ready.values():
    if healthy is None and etcd_healthy():
        healthy = time.time() - tb
    ss = [snap(n) for n in R]
    for n, s in zip(R, ss):
        if s["code"] == 200 and ready[n] is None:
            ready[n] = time.time() - tb; after[n] = s
            print(f"   r{n} ready at +{ready[n]:.1f}s: {json.dumps(s)}", flush=True)
    if time.time() - last >= 0.5:
        last = time.time(); print(line(time.time() - tb, ss), flush=True)
    time.sleep(0.2)
print(f"etcd healthy at +{healthy if healthy is None else round(healthy, 1)}s after restart", flush=True)
for n in R:
    a = after.get(n) or snap(n)
    b = before[n]
    rd = "-" if ready[n] is None else f"{ready[n]:.1f}"
    ur = "never" if unready[n] is None else f"{unready[n]:.1f}"
    print(f"SUMMARY r{n} ttl={TTL} down={DOWN:g}s: unready at +{ur}s after kill; ready {rd}s after etcd back; "
          f"machine_id {b['mid']}->{a['mid']} same={b['mid'] == a['mid']}; lease_id {b['lease']}->{a['lease']} same={b['lease'] == a['lease']}", flush=True)
    print(f"ROW| outage | {TTL} | {DOWN:g} | r{n} | {ur} | {rd if ready[n] is not None else f'not ready in {TIMEOUT:g}'} | "
          f"{b['mid']} → {a['mid']} | {'yes' if b['mid'] == a['mid'] else 'NO'} | {b['lease']} → {a['lease']} | "
          f"{'yes' if b['lease'] == a['lease'] else 'NO'} |", flush=True)
