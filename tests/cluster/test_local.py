from __future__ import annotations

import os
import shutil
import time
from collections.abc import Collection
from pathlib import Path

import pytest

from tests.conftest import ray_processes
from verl_pipeline.cluster import procs
from verl_pipeline.cluster.address import AddressBackend
from verl_pipeline.cluster.base import ClusterHandle, probe
from verl_pipeline.cluster.local import LocalBackend, RayProcess, free_ports, ray_process, stop_stages
from verl_pipeline.cluster.registry import get_backend
from verl_pipeline.exceptions import ClusterError, ConfigError

pytestmark = pytest.mark.integration


def test_local_head_up_and_down_leaves_nothing(tmp_path: Path) -> None:
    temp_dir = Path("/tmp") / f"vp-t-{os.getpid()}"
    # A long grace period costs nothing when every process exits on SIGTERM in the teardown's order.
    backend = LocalBackend.from_spec({"backend": "local", "num_cpus": 1, "temp_dir": str(temp_dir),
                                      "stop_grace_s": 30})
    handle = backend.provision("pytest/up-down")
    try:
        assert handle.dashboard_url == f"http://127.0.0.1:{handle.extra['ports']['dashboard']}"
        status = probe(handle.client())
        assert status.ready and status.nodes_alive == 1 and status.cpus == 1 and status.gpus == 0
        assert ray_processes(str(temp_dir)), "the Ray processes should name their temp dir"
        pids = [procs.ProcRef.from_list(p) for p in handle.extra["pids"]]
        assert len(pids) >= 5
        # One of each process the teardown orders by.
        kinds = [ray_process(cmdline) for cmdline in procs.cmdlines(pids).values()]
        assert [kinds.count(k) for k in (RayProcess.RAYLET, RayProcess.GCS, RayProcess.NODE_ROOT)] == [1, 1, 1]
    finally:
        result = backend.teardown(handle)
    assert result["stopped_processes"] >= 5
    # In Ray's order (raylet, the rest, GCS) each process exits on SIGTERM: none waits out the grace
    # period (the `ray start --block` process, which drains first, is SIGKILLed once its node is gone).
    assert result["killed_after_grace"] == 0
    assert procs.alive(pids) == []
    assert ray_processes(str(temp_dir)) == []
    assert not probe(handle.client()).ready
    # A second teardown is harmless.
    assert backend.teardown(handle)["stopped_processes"] == 0


def test_teardown_stops_raylets_first_and_the_gcs_last_and_kills_the_node_roots() -> None:
    """Ray's own stop order (``ray stop``: raylet, then the rest, then the GCS), then the ``ray start
    --block`` processes, which drain their node on SIGTERM instead of exiting: SIGKILL, nothing waits."""
    site = "/venv/lib/python3.11/site-packages/ray"
    cmdlines = {
        procs.ProcRef(10, 1.0): ["/venv/bin/python", "/venv/bin/ray", "start", "--head", "--block", "--port=6379"],
        procs.ProcRef(11, 1.0): ["/venv/bin/python", "/venv/bin/ray", "start", "--block", "--address=10.0.0.1:6379"],
        procs.ProcRef(12, 1.0): [f"{site}/core/src/ray/gcs/gcs_server", "--log_dir=/tmp/x"],
        procs.ProcRef(13, 1.0): [f"{site}/core/src/ray/raylet/raylet", "--raylet_socket_name=/tmp/x/raylet"],
        procs.ProcRef(14, 1.0): [f"{site}/core/src/ray/raylet/raylet", "--raylet_socket_name=/tmp/x/raylet.1"],
        procs.ProcRef(15, 1.0): ["ray::DashboardAgent"],
        procs.ProcRef(16, 1.0): ["/venv/bin/python", f"{site}/dashboard/dashboard.py", "--host=127.0.0.1"],
        procs.ProcRef(17, 1.0): ["python", "-m", "verl_pipeline.trainer.preflight", "--", "a=1"],
        procs.ProcRef(18, 1.0): ["/venv/bin/python", "/venv/bin/ray", "job", "submit", "--", "ray", "start"],
        procs.ProcRef(19, 1.0): [],
    }
    stages = stop_stages(cmdlines)
    assert [([r.pid for r in s.refs], s.kill) for s in stages] == [
        ([13, 14], False), ([15, 16, 17, 18, 19], False), ([12], False), ([10, 11], True)]
    assert ray_process(["/venv/bin/ray", "start", "--block"]) is RayProcess.NODE_ROOT
    assert ray_process(["/venv/bin/python", "/venv/bin/ray", "start", "--head"]) is RayProcess.OTHER  # not blocking


def test_stages_share_one_grace_period_and_a_sigterm_ignorer_is_killed() -> None:
    """A process that ignores SIGTERM is SIGKILLed when the grace period ends; one that exits on
    SIGTERM is never SIGKILLed; a SIGKILL stage's process (here one that would ignore SIGTERM too) is
    killed without any wait."""
    import subprocess
    import sys

    def start(ignore_sigterm: bool) -> subprocess.Popen[str]:
        handler = "signal.signal(signal.SIGTERM, signal.SIG_IGN); " if ignore_sigterm else ""
        p = subprocess.Popen([sys.executable, "-c", f"import signal, time; {handler}print('ready', flush=True); "
                              "time.sleep(600)"], stdout=subprocess.PIPE, text=True)
        assert p.stdout is not None and p.stdout.readline() == "ready\n"  # the handler is in place
        return p

    ignorer, polite, kill_stage = start(True), start(False), start(True)
    refs = [procs.ProcRef(p.pid, procs.psutil.Process(p.pid).create_time()) for p in (ignorer, polite, kill_stage)]
    report = procs.stop_in_stages([procs.Stage("ignorer", (refs[0],)), procs.Stage("polite", (refs[1],)),
                                   procs.Stage("kill stage", (refs[2],), kill=True)], grace_s=1.0)
    assert report.killed_after_grace == (ignorer.pid,)
    assert (report.stopped, report.left) == (3, ())
    assert procs.alive(refs) == []
    for p in (ignorer, polite, kill_stage):
        p.wait(timeout=30)
        assert p.stdout is not None
        p.stdout.close()


def test_teardown_from_state_file_only(tmp_path: Path) -> None:
    """A teardown that lost the handle (e.g. XCom) still finds the processes by the run's temp dir."""
    backend = LocalBackend.from_spec({"backend": "local", "num_cpus": 1, "stop_grace_s": 3})
    handle = backend.provision("pytest/state-only")
    temp_dir = handle.extra["temp_dir"]
    bare = ClusterHandle(backend="local", name=handle.name, dashboard_url=handle.dashboard_url, owned=True,
                         extra={"temp_dir": temp_dir})
    backend.teardown(bare)
    assert ray_processes(temp_dir) == []


def test_bad_local_settings_are_rejected_before_starting() -> None:
    with pytest.raises(ConfigError, match="num_cpus"):
        LocalBackend.from_spec({"backend": "local", "num_cpus": 0})
    with pytest.raises(ConfigError, match="unknown Ray port"):
        LocalBackend.from_spec({"backend": "local", "ports": {"gcs_port": 1}})
    with pytest.raises(ConfigError, match="0 \\(pick a free port\\) or 1024-65535"):
        LocalBackend.from_spec({"backend": "local", "ports": {"gcs": 80}})
    with pytest.raises(ConfigError, match="unknown setting"):
        LocalBackend.from_spec({"backend": "local", "gpus": 1})
    with pytest.raises(ConfigError, match="unknown backend"):
        get_backend({"backend": "yarn"})


def test_address_backend_times_out_with_a_clear_error() -> None:
    (port,) = free_ports(1)  # nothing listens there
    backend = AddressBackend.from_spec({"backend": "address", "dashboard_url": f"http://127.0.0.1:{port}",
                                        "ready_timeout_s": 2})
    t0 = time.monotonic()
    with pytest.raises(ClusterError, match=r"was not ready after 2s.*unreachable"):
        backend.provision("pytest/nowhere")
    assert time.monotonic() - t0 < 60  # gives up near its 2 s deadline, never hangs


def test_address_backend_reaches_a_running_cluster_and_never_stops_it(ray_cluster: ClusterHandle) -> None:
    spec = {"backend": "address", "dashboard_url": ray_cluster.dashboard_url, "auth_mode": "token"}
    with pytest.raises(ClusterError, match="refused the request"):  # token auth: nothing without the token
        AddressBackend.from_spec({**spec, "ready_timeout_s": 1}).provision("pytest/address")
    backend = AddressBackend.from_spec(spec).with_endpoint(ray_cluster.dashboard_url, ray_cluster.token())
    handle = backend.provision("pytest/address")
    assert not handle.owned
    assert backend.teardown(handle)["stopped_processes"] == 0
    assert probe(ray_cluster.client()).ready


def test_address_backend_requires_a_url() -> None:
    with pytest.raises(ConfigError, match="dashboard URL"):
        AddressBackend.from_spec({"backend": "address"})
    with pytest.raises(ConfigError, match="http"):
        AddressBackend.from_spec({"backend": "address", "dashboard_url": "ray://head:10001"})


def test_worker_port_range_skips_a_slot_where_any_port_is_held(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ray agent port held by another cluster (here: one port in the middle of a slot, on the
    node's own address, as a Ray agent binds it) makes the whole slot unusable; a host with no free
    slot is a clear error, not a guess."""
    import socket

    from verl_pipeline.cluster import local

    span = 40
    # Three candidate slots: [low, low+40), [low+40, low+80), [low+80, low+120).
    low = local.free_port_range(3 * span, low=15000)
    monkeypatch.setattr(local, "_ephemeral_start", lambda: low + 3 * span)
    held = []
    try:
        for port in (low + 3, low + span + 17):  # neither is a multiple of a probing stride from the base
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", port))
            s.listen()
            held.append(s)
        for _ in range(5):  # the slot is picked at random: every pick avoids the held ones
            assert local.free_port_range(span, low=low) == low + 2 * span
        assert local.free_port_range(span, low=low, exclude=()) == low + 2 * span
        with pytest.raises(ClusterError, match=f"no free range of {span} ports"):
            local.free_port_range(span, low=low, exclude=(low + 2 * span,))
    finally:
        for s in held:
            s.close()


def test_worker_port_ranges_stay_clear_of_the_ray_client_servers_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray's client server gives its first client port 23000 without checking it: a worker of
    another cluster there made a Ray client connection fail in CI."""
    from verl_pipeline.cluster import local

    reserved = local.RAY_CLIENT_SERVER_PORTS
    for _ in range(50):  # random picks over the whole window below the ephemeral range
        base = local.free_port_range(200)
        assert base + 200 <= reserved.start or base >= reserved.stop, base
    # A window inside the reserved ports has no slot at all.
    monkeypatch.setattr(local, "_ephemeral_start", lambda: reserved.stop)
    with pytest.raises(ClusterError, match="no free range of 200 ports"):
        local.free_port_range(200, low=reserved.start)


def test_free_ports_are_distinct_and_skip_excluded_ones() -> None:
    """Ray refuses to start when two of its components get one port: every port handed out for a
    node is different, even when the kernel would reuse a just-closed probe port."""
    from verl_pipeline.cluster import local

    first = local.free_ports(9)
    assert len(set(first)) == 9
    again = local.free_ports(9, exclude=set(first))
    assert len(set(again)) == 9
    assert not set(first) & set(again)


def test_a_port_conflict_at_start_is_retried_with_fresh_ports(monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """The first pick hands two Ray components one port (as a kernel reusing a just-closed probe
    port did in CI): `ray start` refuses, and provision starts again on fresh ports instead of
    failing the task."""
    from verl_pipeline.cluster import local

    real = local.free_ports
    calls: list[int] = []

    def first_pick_collides(count: int, exclude: Collection[int] = ()) -> list[int]:
        calls.append(count)
        ports = real(count, exclude=exclude)
        return [ports[0]] * count if len(calls) == 1 else ports

    monkeypatch.setattr(local, "free_ports", first_pick_collides)
    temp_dir = Path("/tmp") / f"vp-t-retry-{os.getpid()}"
    backend = LocalBackend.from_spec({"backend": "local", "num_cpus": 1, "temp_dir": str(temp_dir),
                                      "stop_grace_s": 3})
    with caplog.at_level("WARNING", logger="verl_pipeline.cluster.local"):
        handle = backend.provision("pytest/port-retry")
    try:
        assert len(calls) == 2
        assert "retrying with fresh ports" in caplog.text
        assert handle.client().nodes()
    finally:
        backend.teardown(handle)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_a_port_conflict_that_persists_is_a_clear_error() -> None:
    """Ports pinned in the profile are not changed: two components pinned to one port fail after
    the retries, with Ray's own explanation, and nothing is left running."""

    (port,) = free_ports(1)
    temp_dir = Path("/tmp") / f"vp-t-pinned-{os.getpid()}"
    backend = LocalBackend.from_spec({"backend": "local", "num_cpus": 1, "temp_dir": str(temp_dir),
                                      "ports": {"node_manager": port, "object_manager": port}, "stop_grace_s": 3})
    try:
        with pytest.raises(ClusterError, match="used by other components"):
            backend.provision("pytest/port-pinned")
        assert not procs.alive(procs.with_cmdline(str(temp_dir)))
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_a_job_runs_after_the_directory_the_cluster_was_started_from_is_deleted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A redeployed checkout deletes the directory the pipeline ran in: Ray's processes (and the job
    drivers they start) work in a directory the cluster owns, not in the caller's."""
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    monkeypatch.chdir(checkout)
    backend = LocalBackend.from_spec({"backend": "local", "num_cpus": 1, "stop_grace_s": 3})
    handle = backend.provision("pytest/cwd-deleted")
    try:
        monkeypatch.chdir(tmp_path)
        shutil.rmtree(checkout)
        client = handle.client()
        job_id = f"cwd-{os.getpid()}"
        client.submit(entrypoint="python -c \"import os; print('cwd', os.path.abspath(os.path.curdir))\"",
                      submission_id=job_id, runtime_env={})
        deadline = time.monotonic() + 120
        while (info := client.get_job(job_id)) is None or not info.status.is_terminal():
            assert time.monotonic() < deadline, "the job did not finish"
            time.sleep(0.2)
        logs = client.logs(job_id)
        assert info.status.value == "SUCCEEDED", logs
        assert f"cwd {handle.extra['temp_dir']}" in logs
    finally:
        backend.teardown(handle)
