"""Harness for snowgate etcd-lease fault scenarios.

BIN     = env SNOWGATE (required)
DIR     = env FLEET_FAULTS_RUN (runtime data, logs, pid list); default ${TMPDIR:-/tmp}/snowgate-fleet-faults
Ports:  etcd 23381-23390, gateway i listens on 18080+i, admin on 19090+i.
Every child gets PR_SET_PDEATHSIG=SIGKILL and its pid is appended to DIR/pids,
so measure.sh can kill leftovers even if this process is SIGKILLed.
"""
import base64, ctypes, http.client, json, os, signal, subprocess, threading, time, urllib.request

BIN = os.environ.get("SNOWGATE")
if not BIN:
    raise SystemExit("set SNOWGATE=/path/to/binary")
DIR = os.environ.get("FLEET_FAULTS_RUN", os.path.join(os.environ.get("TMPDIR", "/tmp"), "snowgate-fleet-faults"))
os.makedirs(DIR, exist_ok=True)
PROCS = []
_libc = ctypes.CDLL("libc.so.6", use_errno=True)


def _pdeathsig():
    _libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _term(signum, frame):  # `timeout` sends SIGTERM: run the finally blocks
    raise SystemExit(f"got signal {signum}")


signal.signal(signal.SIGTERM, _term)
signal.signal(signal.SIGHUP, _term)


def spawn(cmd, logpath, env=None):
    logf = open(logpath, "ab")
    p = subprocess.Popen(cmd, stdout=logf, stderr=logf, env=env, preexec_fn=_pdeathsig)
    PROCS.append(p)
    with open(f"{DIR}/pids", "a") as f:
        f.write(f"{p.pid}\n")
    return p, logf


def log(*a):
    print(time.strftime("%H:%M:%S"), "%.3f" % (time.time() % 1), *a, flush=True)


# ---------------------------------------------------------------- etcd
class Etcd:
    def __init__(self, name="e0", client=23381, peer=23382, data=None, cluster=None):
        assert 23381 <= client <= 23390 and 23381 <= peer <= 23390
        self.name, self.client, self.peer = name, client, peer
        self.data = data or f"{DIR}/etcd-{name}"
        self.cluster = cluster or f"{name}=http://127.0.0.1:{peer}"
        self.proc = None

    @property
    def url(self):
        return f"http://127.0.0.1:{self.client}"

    def start(self, wait=True):
        cmd = ["etcd", "--name", self.name, "--data-dir", self.data,
               "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
               "--listen-peer-urls", f"http://127.0.0.1:{self.peer}",
               "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer}",
               "--initial-cluster", self.cluster, "--initial-cluster-token", "snowgate-fleet-faults",
               "--initial-cluster-state", "new", "--log-level", "warn"]
        self.proc, self.logf = spawn(cmd, f"{DIR}/etcd-{self.name}.log")
        if wait:
            self.wait_up()
        return self

    def wait_up(self, timeout=30):
        t0 = time.time()
        while time.time() - t0 < timeout:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if b"true" in r.read():
                        return
            except Exception:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"etcd {self.name} did not come up")

    def sig(self, sig):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wipe(self):
        subprocess.run(["rm", "-rf", self.data])

    def call(self, path, body, timeout=3):
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())


def b64(s):
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode()


def kv_put(etcd, key, value):
    return etcd.call("/v3/kv/put", {"key": b64(key), "value": b64(value)})


# ---------------------------------------------------------------- gateways
class Gateway:
    def __init__(self, i, etcd_urls=None, ttl=None, extra=()):
        assert 0 <= i <= 9
        self.i = i
        self.port, self.admin = 18080 + i, 19090 + i
        self.etcd_urls, self.ttl, self.extra = etcd_urls, ttl, list(extra)
        self.proc = None
        self.logpath = f"{DIR}/gw{i}.log"

    def start(self):
        cmd = [BIN, "serve", "--listen", f"127.0.0.1:{self.port}",
               "--admin-listen", f"127.0.0.1:{self.admin}", "--workers", "1",
               "--plugin-instances", "8", "--shutdown-grace-secs", "5"]
        if self.etcd_urls:
            cmd += ["--etcd", self.etcd_urls]
        if self.ttl:
            cmd += ["--machine-id-ttl", str(self.ttl)]
        cmd += self.extra
        with open(self.logpath, "ab") as f:  # header line starts with '====' (grep -v it)
            f.write(f"==== start {time.strftime('%H:%M:%S')} {' '.join(cmd)}\n".encode())
        self.started_at = time.time()
        self.proc, self.logf = spawn(cmd, self.logpath)
        return self

    def admin_get(self, path, timeout=1):
        try:
            c = http.client.HTTPConnection("127.0.0.1", self.admin, timeout=timeout)
            c.request("GET", path)
            r = c.getresponse()
            return r.status, r.read().decode(errors="replace")
        except Exception as e:
            return None, str(e)

    def status(self):
        s, body = self.admin_get("/status")
        try:
            return json.loads(body)
        except Exception:
            return None

    def ready(self):
        return self.admin_get("/readyz")

    def wait_ready(self, timeout=60):
        t0 = time.time()
        while time.time() - t0 < timeout:
            s, b = self.ready()
            if s == 200:
                return time.time() - t0
            if self.proc.poll() is not None:
                raise RuntimeError(f"gw{self.i} exited with {self.proc.returncode}")
            time.sleep(0.1)
        raise RuntimeError(f"gw{self.i} not ready after {timeout}s: {self.ready()} {self.status()}")

    def stop(self, sig=15, timeout=15):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill(); self.proc.wait()
        return self.proc.returncode if self.proc else None


def batch_body(n):
    item = b'{"prompt":"x","max_tokens":1,"disaggregated_params":{"request_type":"context_only"}}'
    return b"[" + b",".join([item] * n) + b"]"


class Prober:
    """One thread posting one context-only request at a time (pause 50 ms);
    records (time the answer came, status) for every request."""

    def __init__(self, gw, pause=0.05, timeout=5):
        self.gw, self.pause, self.timeout = gw, pause, timeout
        self.events = []
        self.stop_ev = threading.Event()
        self.th = threading.Thread(target=self.run, daemon=True)

    def start(self):
        self.th.start(); return self

    def run(self):
        body = batch_body(1)
        conn = None
        while not self.stop_ev.is_set():
            try:
                if conn is None:
                    conn = http.client.HTTPConnection("127.0.0.1", self.gw.port, timeout=self.timeout)
                conn.request("POST", "/v1/completions", body=body, headers={"content-type": "application/json"})
                r = conn.getresponse(); r.read()
                self.events.append((time.time(), r.status))
                if r.getheader("connection", "").lower() == "close":
                    conn.close(); conn = None
            except Exception:
                self.events.append((time.time(), "exc"))
                try:
                    conn and conn.close()
                except Exception:
                    pass
                conn = None
            time.sleep(self.pause)

    def stop(self):
        self.stop_ev.set(); self.th.join(10)

    def second(self, sec):
        c = {}
        for t, s in self.events:
            if int(t) == sec:
                c[s] = c.get(s, 0) + 1
        return c

    def stats(self, t0, t1):
        """Counts in [t0, t1) and the longest stretch without a 200: from the
        first non-200 answer after a 200 (or t0) to the next 200 (or t1)."""
        ev = [(t, s) for t, s in list(self.events) if t0 <= t < t1]
        n = {"200": 0, "503": 0, "other": 0}
        first_bad = last_bad = None
        longest, run_start, longest_open = 0.0, None, False
        for t, s in ev:
            if s == 200:
                n["200"] += 1
                if run_start is not None:
                    longest = max(longest, t - run_start); run_start = None
            else:
                n["503" if s == 503 else "other"] += 1
                if first_bad is None:
                    first_bad = t - t0
                last_bad = t - t0
                if run_start is None:
                    run_start = t
        if run_start is not None and t1 - run_start > longest:
            longest, longest_open = t1 - run_start, True
        return dict(n200=n["200"], n503=n["503"], nother=n["other"], first_bad=first_bad,
                    last_bad=last_bad, longest=longest, longest_open=longest_open)


def fmt(x, nd=1):
    return "-" if x is None else f"{x:.{nd}f}"


def cleanup():
    for p in PROCS:
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGCONT)
                p.kill(); p.wait(10)
            except Exception:
                pass


def tear_down(members):
    """Ends every process started here, members that a scenario stopped (SIGSTOP) included,
    and removes the members' data directories."""
    for m in members:
        m.sig(signal.SIGCONT)
    cleanup()
    for m in members:
        m.wipe()


def machine_of(status):
    try:
        return status["lease"]["machine_id"], status["lease"]["state"]
    except Exception:
        return None


def watch_seconds(g, pr, seconds, t0):
    """Logs, once a second for `seconds`, the answers of the last second
    (from Prober `pr`), /readyz and the lease of gateway `g`; returns how
    many /readyz samples were not 200."""
    unready = 0
    for _ in range(seconds):
        time.sleep(1)
        c = pr.second(int(time.time()) - 1)
        rs, rb = g.ready()
        unready += rs != 200
        le = (g.status() or {}).get("lease") or {}
        log(f"t+{time.time() - t0:5.1f}s 200={c.get(200, 0):3d} 503={c.get(503, 0):3d} exc={c.get('exc', 0)} "
            f"readyz={rs} {rb.strip()[:60]!r} lease={le.get('state')}/{le.get('machine_id')} "
            f"last_renewed={le.get('last_renewed')} last_error={str(le.get('last_error'))[:80]!r}")
    return unready


def summarize(name, what, ttl, observe, pr, t0, t1, unready):
    """Prints the SUMMARY line and the summary table's ROW for the
    answers Prober `pr` saw between t0 and t1."""
    s = pr.stats(t0, t1)
    log(f"SUMMARY {what} {observe}s ttl={ttl}: 200={s['n200']} 503={s['n503']} other={s['nother']} "
        f"first_non200=+{fmt(s['first_bad'])}s last_non200=+{fmt(s['last_bad'])}s "
        f"longest_without_200={fmt(s['longest'])}s{' (still at end)' if s['longest_open'] else ''} "
        f"readyz_non200_samples={unready}/{observe}")
    print(f"ROW| {name} | {ttl} | {observe} | {s['n200']} | {s['n503']} | {s['nother']} | "
          f"{fmt(s['first_bad'])} | {fmt(s['last_bad'])} | {fmt(s['longest'])}{'+' if s['longest_open'] else ''} | "
          f"{unready}/{observe} |", flush=True)
