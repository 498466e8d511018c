#!/usr/bin/env python3
"""tiny etcd v3 JSON client: etcdkv.py get PREFIX | put KEY VAL | del PREFIX"""
import sys, json, base64, urllib.request
EP = "http://127.0.0.1:23381"
def b(s): return base64.b64encode(s.encode()).decode()
def d(s): return base64.b64decode(s).decode(errors="replace")
def call(path, body):
    r = urllib.request.Request(EP + path, data=json.dumps(body).encode(), method="POST")
    return json.load(urllib.request.urlopen(r, timeout=5))
def prefix_end(p):
    bs = bytearray(p.encode()); bs[-1] += 1; return base64.b64encode(bytes(bs)).decode()
cmd = sys.argv[1]
if cmd == "get":
    r = call("/v3/kv/range", {"key": b(sys.argv[2]), "range_end": prefix_end(sys.argv[2])})
    for kv in r.get("kvs", []):
        print(d(kv["key"]), d(kv.get("value", "")), "lease=" + kv.get("lease", "0"))
elif cmd == "put":
    print(call("/v3/kv/put", {"key": b(sys.argv[2]), "value": b(sys.argv[3])}))
elif cmd == "del":
    print(call("/v3/kv/deleterange", {"key": b(sys.argv[2]), "range_end": prefix_end(sys.argv[2])}))
