"""Token auth on the clusters the pipeline starts: the real local backend refuses callers without the token.

All cluster tests share the session's one local head (``ray_cluster``): it is started with token auth,
as every local cluster is unless its profile says ``auth_mode: disabled``.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import requests

from verl_pipeline import auth
from verl_pipeline.cluster.base import ClusterHandle
from verl_pipeline.cluster.local import LocalBackend
from verl_pipeline.constants import JobState
from verl_pipeline.exceptions import ClusterError, ConfigError


def _driver(code: str, env: dict[str, str], timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter with only ``env``'s Ray auth settings (none of this process's)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    # One attempt each (Ray retries a refused GCS for ~20 s and a refused client for ~30 s by default).
    base.update({"RAY_gcs_server_port_wait_time_s": "1", "RAY_CLIENT_INITIAL_CONNECTION_TIMEOUT_S": "1",
                 "RAY_USAGE_STATS_ENABLED": "0", **env})
    return subprocess.run([sys.executable, "-c", code], env=base, capture_output=True, text=True, timeout=timeout_s)


def test_local_clusters_use_token_auth_by_default() -> None:
    assert LocalBackend.from_spec({"backend": "local"}).auth_mode is auth.AuthMode.TOKEN
    assert LocalBackend.from_spec({"backend": "local", "auth_mode": "disabled"}).auth_mode is auth.AuthMode.DISABLED
    with pytest.raises(ConfigError, match=r"cluster.auth_mode='off': must be token or disabled"):
        LocalBackend.from_spec({"backend": "local", "auth_mode": "off"})


def test_the_token_is_in_a_private_file_and_the_handle_holds_only_its_path(ray_cluster: ClusterHandle) -> None:
    assert ray_cluster.auth_mode == "token" and ray_cluster.token_file
    path = Path(ray_cluster.token_file)
    token = ray_cluster.token()
    assert token and len(token) == 64
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700 and path.parent.stat().st_uid == os.getuid()
    # XCom, trigger kwargs and the state file carry the handle: the path, never the token.
    assert token not in json.dumps(ray_cluster.to_dict())
    state = Path(ray_cluster.extra["temp_dir"]) / "verl_pipeline_cluster.json"
    assert token not in state.read_text()


def test_jobs_api_refuses_requests_without_the_right_token(ray_cluster: ClusterHandle) -> None:
    url = f"{ray_cluster.dashboard_url}/api/jobs/"
    assert requests.get(url, timeout=10).status_code == 401
    assert requests.get(url, headers={"Authorization": "Bearer " + "0" * 64}, timeout=10).status_code == 403
    assert requests.post(url, json={"entrypoint": "id"}, timeout=10).status_code == 401
    assert requests.get(url, headers={"Authorization": f"Bearer {ray_cluster.token()}"}, timeout=10).status_code == 200


#: What Ray's client proxy raises when the server process it started for a client exited at once: it
#: says so when it sees the exit, or fails on psutil's ZombieProcess when the exit lands between its
#: check and its read of the process's command line (seen once in CI).
RAY_CLIENT_SERVER_DIED = ("Starting Ray client server failed", "psutil.ZombieProcess")


# The Ray client server starts a server per client on ports from 23000 up: two clusters' client
# servers on one host at once get in each other's way.
@pytest.mark.serial
def test_a_driver_or_ray_client_without_the_token_is_refused(ray_cluster: ClusterHandle) -> None:
    t0 = time.monotonic()
    with_token = {"RAY_AUTH_MODE": "token", auth.TOKEN_PATH_VAR: str(ray_cluster.token_file)}
    port = ray_cluster.extra["ports"]["ray_client_server"]
    gcs = f"import ray; ray.init(address={ray_cluster.gcs_address!r}); print('CONNECTED')"
    client = f"import ray; ray.init('ray://127.0.0.1:{port}'); print('CONNECTED', ray.cluster_resources()['CPU'])"
    # With the token (Ray reads it from the file, as a job's driver does) both connect. The Ray
    # client goes first: its proxy does not recover from a refused client within the test's time.
    for code in (client, gcs):
        for _ in range(3):
            # The client server starts a process per client: on a busy machine that takes seconds.
            ok = _driver(code, {**with_token, "RAY_CLIENT_INITIAL_CONNECTION_TIMEOUT_S": "60"}, timeout_s=180)
            # Under load, the process Ray's proxy forks for a client can die before it runs a line (its
            # log file stays empty; seen three times in CI). That is Ray failing to start its server, not
            # a refusal (which names ConnectionError or AuthenticationError): connect again, as a new client.
            if not any(sign in ok.stderr for sign in RAY_CLIENT_SERVER_DIED):
                break
        assert ok.returncode == 0 and "CONNECTED" in ok.stdout, ok.stderr[-2000:]
    # One attempt for a refused client (ray.init would retry for ~20 s).
    refused_client = f"import ray; ray.util.connect('127.0.0.1:{port}', connection_retries=1); print('CONNECTED')"
    for code in (gcs, refused_client):
        for env in ({"RAY_AUTH_MODE": "disabled"}, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64}):
            refused = _driver(code, env)
            assert refused.returncode != 0 and "CONNECTED" not in refused.stdout, (code, env, refused.stdout)
            assert "ConnectionError" in refused.stderr or "AuthenticationError" in refused.stderr, \
                refused.stderr[-2000:]
    print(f"2 connections + 4 refusals: {time.monotonic() - t0:.1f}s")


def test_a_job_submitted_with_the_token_runs_and_its_driver_reaches_the_cluster(ray_cluster: ClusterHandle) -> None:
    client = ray_cluster.client()
    sub_id = f"auth-driver-{os.getpid()}-{int(time.time())}"
    code = ("import os, ray; ray.init(); print('ANSWER', ray.get(ray.remote(lambda: 6 * 7).remote()), "
            "'TOKEN_IN_ENV', 'RAY_AUTH_TOKEN' in os.environ)")
    client.submit(entrypoint=f"python -c {json.dumps(code)}", submission_id=sub_id, runtime_env={}, metadata={})
    deadline = time.monotonic() + 120
    info = client.get_job(sub_id)
    while info is None or not info.status.is_terminal():
        assert time.monotonic() < deadline, f"job {sub_id} still {info and info.status} after 120s"
        time.sleep(0.5)
        info = client.get_job(sub_id)
    logs = client.logs(sub_id)
    assert info.status is JobState.SUCCEEDED, logs
    # The driver got the token by its file (inherited RAY_AUTH_TOKEN_PATH), not by value.
    assert "ANSWER 42 TOKEN_IN_ENV False" in logs
    token = ray_cluster.token()
    assert token and token not in json.dumps(info.to_dict()) and token not in logs
    # Nor anywhere in Ray's own files of the cluster (session logs of GCS, dashboard, raylet, driver),
    # nor in any job's info or log through the Jobs API (the canary scanner's view: it does see the
    # job's entrypoint, which names ANSWER).
    from tests.integration.secret_canary import jobs_api_leaks, scan_files

    assert scan_files([Path(ray_cluster.extra["temp_dir"])], {"ray token": token}) == []
    seen = jobs_api_leaks(ray_cluster.to_dict(), {"ray token": token, "control": "'ANSWER', ray.get"})
    assert {leak.secret for leak in seen} == {"control"} and any("/api/jobs/" in leak.where for leak in seen)


def test_a_token_file_others_can_read_is_refused(tmp_path: Path) -> None:
    path = auth.write_token_file(tmp_path / "auth")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    first = auth.read_token_file(path)
    assert auth.read_token_file(auth.write_token_file(tmp_path / "auth")) != first  # fresh per cluster
    path.chmod(0o644)
    with pytest.raises(ClusterError, match="others can read it"):
        auth.read_token_file(path)


def test_a_state_dir_someone_else_can_write_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ClusterError, match="others could replace the cluster's files"):
        auth.write_token_file(shared)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(ClusterError, match="symlink"):
        auth.private_dir(link)


@pytest.mark.parametrize("name,refused", [
    ("HF_TOKEN", True), ("WANDB_API_KEY", True), ("AWS_SECRET_ACCESS_KEY", True), ("MLFLOW_TRACKING_PASSWORD", True),
    ("RAY_AUTH_TOKEN", True), ("TOKENIZERS_PARALLELISM", False), ("NCCL_IB_HCA", False), ("HF_TOKEN_PATH", False),
])
def test_a_secret_in_the_jobs_runtime_env_is_refused(name: str, refused: bool) -> None:
    if refused:
        with pytest.raises(ConfigError, match=r"readable by anyone who can read the Ray Jobs API") as e:
            auth.check_job_env({name: "value"}, "clusters/x.runtime.env")
        assert e.value.key == f"clusters/x.runtime.env.{name}" and "value" not in str(e.value)
    else:
        auth.check_job_env({name: "1"}, "clusters/x.runtime.env")


@pytest.fixture(scope="module")
def open_cluster() -> Iterator[ClusterHandle]:
    """A second real local head, started with ``auth_mode: disabled`` (one per module: ~10 s)."""
    backend = LocalBackend.from_spec({"backend": "local", "num_cpus": 1, "stop_grace_s": 3, "auth_mode": "disabled"})
    handle = backend.provision(f"pytest/open-cluster-{os.getpid()}")
    yield handle
    backend.teardown(handle)


def _talk(handle: ClusterHandle, tag: str) -> None:
    """Every kind of call the pipeline makes with a handle's auth: REST (sync and async) and Ray's SDK."""
    client = handle.client()
    assert client.auth_mode.value == handle.auth_mode
    assert client.version().get("ray_version") and any(n.alive for n in client.nodes())
    sub_id = client.submit(entrypoint="echo hello", submission_id=f"auth-{tag}-{os.getpid()}-{time.monotonic_ns()}",
                           runtime_env={})
    assert client.get_job(sub_id) is not None and any(j.submission_id == sub_id for j in client.list_jobs())

    async def poll() -> None:
        async with aiohttp.ClientSession() as session:
            info = await handle.client(session=session).aget_job(sub_id)
            assert info is not None and info.submission_id == sub_id

    asyncio.run(poll())


@pytest.mark.parametrize("order", ["token-then-disabled", "disabled-then-token"])
def test_one_process_talks_to_a_token_and_an_auth_disabled_cluster(
        order: str, ray_cluster: ClusterHandle, open_cluster: ClusterHandle) -> None:
    assert ray_cluster.auth_mode == "token" and open_cluster.auth_mode == "disabled"
    before = os.environ.get(auth.MODE_VAR)
    handles = [ray_cluster, open_cluster] if order == "token-then-disabled" else [open_cluster, ray_cluster]
    for handle in handles:
        _talk(handle, handle.auth_mode)
        assert os.environ.get(auth.MODE_VAR) == before
    # The open cluster got no token: the client of an auth-disabled cluster sends none.
    assert open_cluster.client(token="0" * 64).headers == {}


def test_ray_sdk_adds_no_token_of_the_process_to_a_cluster_without_auth(
        ray_cluster: ClusterHandle, open_cluster: ClusterHandle) -> None:
    """A process whose Ray reads ``RAY_AUTH_MODE=token`` (once, for good) and whose own token file is gone.

    Ray's SDK would add that process's token to the auth-disabled cluster's requests (here: raise,
    the file being missing); the client gives its own headers instead, in both orders.
    """
    code = (
        "import json, sys\n"
        "from tests.cluster.test_auth import _talk\n"
        "from verl_pipeline.cluster.base import ClusterHandle\n"
        "token, open_ = (ClusterHandle.from_dict(json.loads(a)) for a in sys.argv[1:3])\n"
        "for handle in (token, open_, token):\n"
        "    _talk(handle, 'process-token-mode')\n"
        "print('ALL CALLS OK')\n"
    )
    env = {**os.environ, "RAY_AUTH_MODE": "token", auth.TOKEN_PATH_VAR: "/nonexistent/ray_auth_token"}
    r = subprocess.run([sys.executable, "-c", code, json.dumps(ray_cluster.to_dict()),
                        json.dumps(open_cluster.to_dict())], env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0 and "ALL CALLS OK" in r.stdout, r.stderr[-3000:]
