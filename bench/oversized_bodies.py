#!/usr/bin/env python3
"""Whether clients that send a body over the gateway's limit get its 413.

    target/release/snowgate serve --listen 127.0.0.1:46180 --admin-listen 127.0.0.1:46181 --machine-id 1 &
    bench/oversized_bodies.py 46180

Sends a 40 MiB JSON body (over the default --max-body-bytes of 32 MiB) ten
times with Python's http.client, which writes the whole body before it reads,
and ten times as a raw head, a 20 ms pause (a round trip), then the body, and
prints how many got the 413 and how many a connection error (a broken pipe or
a reset: the gateway closed with the body unread). Needs python3.
"""
import http.client, socket, sys, time
port = int(sys.argv[1])
body = b'{"prompt":"' + b'a'*(40<<20) + b'"}'
ok = err = 0
for i in range(10):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        c.request("POST", "/v1/completions", body=body, headers={"content-type": "application/json"})
        r = c.getresponse(); st = r.status; r.read()
        ok += st == 413
    except Exception as e:
        err += 1
    c.close()
print("http.client: 413", ok, "errors", err)
ok = err = 0
head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
for i in range(10):
    s = socket.create_connection(("127.0.0.1", port))
    try:
        s.sendall(head); time.sleep(0.02); s.sendall(body)
        data = b""
        while True:
            got = s.recv(65536)
            if not got: break
            data += got
        ok += data.startswith(b"HTTP/1.1 413")
    except Exception as e:
        err += 1
    s.close()
print("head, 20 ms, body: 413", ok, "errors", err)
