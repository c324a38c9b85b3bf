"""Run by test_ray_serve.py in a process of its own (so that a hang is bounded by its
timeout): serves a saved program with examples/ray_serve.py on 127.0.0.1, sends requests
from several threads at once, writes what came back as JSON, and shuts everything down."""

import json
import socket
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import ray
import ray_serve  # examples/, on PYTHONPATH for this process and Ray's workers
from ray import serve

path, requests_file, results_file = sys.argv[1], sys.argv[2], sys.argv[3]
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]


def post(body: bytes):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/", data=body, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
try:
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(ray_serve.app(path, replicas=2), route_prefix="/")
    bodies = [b.encode() for b in json.load(open(requests_file))]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(post, bodies))
    with open(results_file, "w") as f:
        json.dump(results, f)
finally:
    serve.shutdown()
    ray.shutdown()
