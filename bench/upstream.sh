# Shared by bench/cpu_split.sh and bench/gateway_instructions.sh (sourced,
# not run): a free port, bench/load.py's request body, and nginx answering
# `return 200` as the upstream.

# A free TCP port on loopback.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# write_body DIR SIZE: bench/load.py's SIZE body (1KiB, 64KiB) as DIR/body.json.
write_body() {
    python3 - "$(dirname "${BASH_SOURCE[0]}")" "$1" "$2" <<'PY'
import sys
sys.path.insert(0, sys.argv[1])
import load
bodies = load.make_bodies()
if sys.argv[3] not in bodies:
    sys.exit(f"SIZE must be one of {', '.join(bodies)}, not {sys.argv[3]!r}")
open(sys.argv[2] + "/body.json", "wb").write(bodies[sys.argv[3]])
PY
}

# start_upstream DIR PORT: nginx on 127.0.0.1:PORT answering every request
# with 200 at once, its files in DIR; it stops with `kill $(cat DIR/nginx.pid)`.
start_upstream() {
    cat > "$1/nginx.conf" <<EOF
worker_processes 1;
pid $1/nginx.pid;
error_log $1/error.log warn;
daemon on;
events { worker_connections 1024; }
http {
    access_log off;
    keepalive_requests 1000000;
    client_body_temp_path $1/body;
    proxy_temp_path $1/proxy;
    fastcgi_temp_path $1/fastcgi;
    uwsgi_temp_path $1/uwsgi;
    scgi_temp_path $1/scgi;
    server { listen 127.0.0.1:$2; location / { return 200 '{"ok":true}\n'; } }
}
EOF
    nginx -c "$1/nginx.conf" -p "$1"
}
