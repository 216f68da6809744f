"""Does a job on the pipeline's Ray cluster run slower than the same driver on a Ray of its own?

Usage: .venv/bin/python bench/job_vs_bare_ray.py [--rounds 4] [--calls 2000] [--auth token|disabled]

The 0.5B GRPO pairs on the GPU machines ran the DAG's job first and its bare-verl twin second, and the
DAG's was slower in CPU-bound work that the pipeline does not touch (vLLM's torch.compile, generation
that leaves the GPU four fifths idle). What the pipeline changes for the job's processes is its cluster:
a ``ray start`` head with token auth, an object store of the profile's size, the driver started by Ray's
job supervisor with the package in ``py_modules``, and the waiter reading the job's log. This runs one
workload both ways, on the CPU, and compares:

- ``call_us``: one actor call's round trip, the median of ``--calls`` in a row (verl's agent loop and its
  workers talk through such calls);
- ``spin_s``: a fixed pure-Python loop inside an actor (the kind of work torch.compile and the agent
  loop do);
- ``put_get_s``: putting and getting a 64 MB array five times (the object store).

The cluster is the project's local backend with the GPU runs' cluster profile (``local-gpu``: token auth,
its object store) on this machine's CPUs, started once, as one DAG run's is; the job is submitted through
the project's Jobs API client with the package in ``py_modules``, and its status and log are read every
second while it runs, as the waiter reads them. The bare
driver starts its own Ray with ``ray.init``, as bare verl does. The rounds alternate their order (job
first, then bare first) so that a machine getting faster or slower over the run does not favour one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: The workload, run as a Ray driver both ways; it prints one line ``RESULT {json}``.
WORKLOAD = r'''
import json, statistics, sys, time
import numpy as np
import ray

calls = int(sys.argv[1])
ray.init(**({} if len(sys.argv) < 3 else {"num_cpus": int(sys.argv[2])}))

@ray.remote(num_cpus=0)
class Echo:
    def ping(self, x):
        return x

@ray.remote(num_cpus=0)
class Spin:
    def spin(self, n):
        t = time.perf_counter()
        acc = 0
        for i in range(n):
            acc += i * i % 7
        return time.perf_counter() - t

echo, spin = Echo.remote(), Spin.remote()
time.sleep(5)  # a Ray of its own is still starting its processes: measured once the machine has settled
ray.get([echo.ping.remote(0) for _ in range(50)])
ray.get(spin.spin.remote(1000))
lat = []
for i in range(calls):
    t = time.perf_counter()
    ray.get(echo.ping.remote(i))
    lat.append(time.perf_counter() - t)
spin_s = ray.get(spin.spin.remote(20_000_000))
arr = np.ones(64 * 1024 * 1024 // 8)
t = time.perf_counter()
for _ in range(5):
    assert ray.get(ray.put(arr)).shape == arr.shape
put_get_s = time.perf_counter() - t
print("RESULT " + json.dumps({"call_us": statistics.median(lat) * 1e6, "spin_s": spin_s, "put_get_s": put_get_s}),
      flush=True)
'''

FIGURES = ("call_us", "spin_s", "put_get_s")
#: The cluster profile whose settings the job's cluster takes: the one the GPU runs use.
CLUSTER_PROFILE = "local-gpu"


def _result(text: str) -> dict[str, float]:
    for line in text.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line.removeprefix("RESULT "))
    raise SystemExit(f"the workload printed no result:\n{text[-3000:]}")


def run_as_job(handle: Any, script: Path, calls: int, n: int) -> dict[str, float]:
    """The workload as a job on the pipeline's cluster, its log read every second until it ends."""
    from verl_pipeline.constants import JobState
    from verl_pipeline.paths import package_dir

    client = handle.client()
    job_id = f"job-vs-bare-{os.getpid()}-{n}"
    client.submit(entrypoint=f"python {script} {calls}", submission_id=job_id,
                  runtime_env={"py_modules": [str(package_dir())]})
    deadline = time.monotonic() + 600
    while True:
        info = client.get_job(job_id)
        client.logs(job_id)
        if info is not None and info.status.is_terminal():
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"job {job_id} did not end in 600 s")
        time.sleep(1)
    text = client.logs(job_id)
    if info.status is not JobState.SUCCEEDED:
        raise SystemExit(f"job {job_id} ended {info.status.value}:\n{text[-3000:]}")
    return _result(text)


def run_bare(script: Path, calls: int, num_cpus: int) -> dict[str, float]:
    """The workload as a driver that starts its own Ray (and stops it when it exits)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.setdefault("RAY_AUTH_MODE", "disabled")
    proc = subprocess.run([sys.executable, str(script), str(calls), str(num_cpus)], env=env, capture_output=True,
                          text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"the bare driver exited {proc.returncode}:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return _result(proc.stdout)


def summarise(runs: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Each figure's median per way, and the job's over the bare driver's."""
    out: dict[str, Any] = {"rounds": len(runs["job"])}
    for fig in FIGURES:
        job, bare = (statistics.median(r[fig] for r in runs[way]) for way in ("job", "bare"))
        out[fig] = {"job": round(job, 4), "bare": round(bare, 4), "ratio": round(job / bare, 3),
                    "job_all": [round(r[fig], 4) for r in runs["job"]],
                    "bare_all": [round(r[fig], 4) for r in runs["bare"]]}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--auth", choices=("token", "disabled"), default="token",
                   help="the pipeline's cluster's auth mode (token: the profile's)")
    args = p.parse_args()
    import yaml

    from verl_pipeline.cluster.local import LocalBackend
    from verl_pipeline.paths import configs_dir

    # The GPU runs' cluster profile as it is (auth, object store, …), on this machine's CPUs and no GPU.
    num_cpus = os.cpu_count() or 2
    spec = yaml.safe_load((configs_dir() / "clusters" / f"{CLUSTER_PROFILE}.yaml").read_text())["cluster"]
    spec.update(num_cpus=num_cpus, num_gpus=0, auth_mode=args.auth)
    backend = LocalBackend.from_spec(spec)
    runs: dict[str, list[dict[str, float]]] = {"job": [], "bare": []}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "workload.py"
        script.write_text(WORKLOAD)
        handle = backend.provision(f"bench/job-vs-bare-{os.getpid()}")
        try:
            for n in range(args.rounds):
                order = ("job", "bare") if n % 2 == 0 else ("bare", "job")
                for way in order:
                    r = run_as_job(handle, script, args.calls, n) if way == "job" else run_bare(script, args.calls,
                                                                                               num_cpus)
                    runs[way].append(r)
                    print(f"round {n + 1} {way}: " + ", ".join(f"{k} {v:.4g}" for k, v in r.items()), flush=True)
        finally:
            backend.teardown(handle)
    summary = {"machine": {"cpus": num_cpus}, "calls": args.calls, "auth": args.auth, **summarise(runs)}
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
