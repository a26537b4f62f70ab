"""The README's "Watching it work" commands, as a script a clean install of
``shardkit[metrics,dashboard]`` runs: ``python monitoring.py STORE_URL PREFIX PORT PORT``
counts, starts ``shardkit metrics`` and ``shardkit dashboard`` on the two ports, reads
them over HTTP and prints what they served, as JSON."""

import json
import subprocess
import sys
import time
import urllib.request
import uuid

import shardkit

store, prefix, metrics_port, dashboard_port = sys.argv[1:]
name = f"readme:{uuid.uuid4().hex}"
with shardkit.connect(store=store, prefix=prefix) as kit:
    kit.sharded(name).incr(3)
command = [sys.executable, "-m", "shardkit", "--store", store, "--prefix", prefix]
servers = [
    subprocess.Popen([*command, "metrics", "--port", metrics_port, "--counter", name]),
    subprocess.Popen([*command, "dashboard", "--port", dashboard_port]),
]


def read(url: str) -> str:
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return str(response.read().decode())
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


try:
    metrics = read(f"http://127.0.0.1:{metrics_port}/metrics")
    page = read(f"http://127.0.0.1:{dashboard_port}/")
    counters = json.loads(read(f"http://127.0.0.1:{dashboard_port}/api/counters?prefix={name}"))
finally:
    for server in servers:
        server.terminate()
        server.wait(30)
value = f'shardkit_value{{counter="{name}",kind="sharded"}} 3.0'
print(
    json.dumps(
        {
            "metric": value in metrics.splitlines(),
            "page": "<title>shardkit</title>" in page,
            "counters": [(c["kind"], c["value"]) for c in counters["counters"]],
        }
    )
)
