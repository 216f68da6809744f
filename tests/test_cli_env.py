"""``verl-pipeline cluster env``: Ray's own CLI against a pipeline cluster, token auth on, in one step."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from verl_pipeline import auth
from verl_pipeline.cli import _spec, build_parser, main, ray_shell_env
from verl_pipeline.cluster.base import ClusterHandle
from verl_pipeline.cluster.registry import get_backend
from verl_pipeline.cluster.slurm import SlurmBackend
from verl_pipeline.exceptions import ClusterError, PipelineError
from verl_pipeline.rundir import RunDir

BIN = Path(sys.executable).parent


def _evaluated(lines: str, environ: dict[str, str], *names: str) -> dict[str, str | None]:
    """``names`` as bash sees them after ``eval`` of ``lines`` in ``environ`` (None: unset)."""
    script = 'eval "$1"; shift; for n in "$@"; do if [ -n "${!n+x}" ]; then printf "%s=%s\\0" "$n" "${!n}"; fi; done'
    r = subprocess.run(["bash", "-c", script, "bash", lines, *names], env=environ, capture_output=True, text=True,
                       check=True, timeout=30)
    got = dict(item.split("=", 1) for item in r.stdout.split("\0") if item)
    return {name: got.get(name) for name in names}


RAY_VARS = ("RAY_ADDRESS", auth.MODE_VAR, auth.TOKEN_PATH_VAR, auth.TOKEN_VAR)


# -- the rendering, per backend (no cluster needed) --------------------------------------------------------
def test_a_slurm_allocation_gives_its_token_files_path_and_an_inherited_token_is_removed(tmp_path: Path) -> None:
    backend = get_backend({"backend": "slurm", "shared_dir": str(tmp_path / "shared dir's"), "nodes": 2})
    assert isinstance(backend, SlurmBackend)
    token_file = backend.token_file_for("verl_ppo/run 1")
    assert token_file is not None
    auth.write_token_file(token_file.parent)  # as the backend does before sbatch
    token = auth.read_token_file(token_file)
    handle = ClusterHandle(backend="slurm", name="verl_ppo/run 1", dashboard_url="http://gpu-node-07:8265", owned=True,
                           auth_mode="token", token_file=str(token_file), gcs_address="10.1.2.7:6379")
    env = ray_shell_env(handle, {})
    assert token not in env.shell() and token not in json.dumps(env.to_dict())
    inherited = {"PATH": os.environ["PATH"], auth.TOKEN_VAR: "someone-elses-token", auth.MODE_VAR: "disabled"}
    assert _evaluated(env.shell(), inherited, *RAY_VARS) == {
        "RAY_ADDRESS": "http://gpu-node-07:8265", auth.MODE_VAR: "token", auth.TOKEN_PATH_VAR: str(token_file),
        auth.TOKEN_VAR: None}
    assert "# ray status --address 10.1.2.7:6379" in env.shell()


def test_a_token_file_that_is_gone_or_readable_by_others_is_named_not_printed(tmp_path: Path) -> None:
    token_file = auth.write_token_file(tmp_path / "auth")
    handle = ClusterHandle(backend="slurm", name="r", dashboard_url="http://head:8265", owned=True,
                           auth_mode="token", token_file=str(token_file))
    token_file.chmod(0o644)
    with pytest.raises(ClusterError, match=r"has mode -rw-r--r--: others can read it \(fix: chmod 600"):
        ray_shell_env(handle, {})
    token_file.unlink()
    with pytest.raises(ClusterError, match=r"cannot read the Ray token file .*provision the cluster again"):
        ray_shell_env(handle, {})
    with pytest.raises(PipelineError, match=r"no dashboard URL yet .*cluster status"):
        ray_shell_env(ClusterHandle(backend="slurm", name="r", dashboard_url="", owned=True), {})


def test_an_address_cluster_takes_the_token_from_the_shells_variable_never_from_the_output() -> None:
    handle = ClusterHandle(backend="address", name="r", dashboard_url="https://ray.example.org", owned=False,
                           auth_mode="token", conn_id="ray_default", ca_bundle="/etc/ssl/my ca.pem")
    secret = "canary-7f3e-not-for-output"
    env = ray_shell_env(handle, {auth.PIPELINE_TOKEN_VAR: secret})
    assert secret not in env.shell() and not env.warnings
    shell = {"PATH": os.environ["PATH"], auth.PIPELINE_TOKEN_VAR: secret, auth.TOKEN_PATH_VAR: "/other/cluster"}
    assert _evaluated(env.shell(), shell, *RAY_VARS) == {
        "RAY_ADDRESS": "https://ray.example.org", auth.MODE_VAR: "token", auth.TOKEN_PATH_VAR: None,
        auth.TOKEN_VAR: secret}
    assert "--verify '/etc/ssl/my ca.pem'" in env.shell()
    # Without the variable: the address and mode, and a warning naming where the token is and the fix.
    env = ray_shell_env(handle, {})
    assert auth.TOKEN_VAR not in env.values and not env.copies
    (warning,) = env.warnings
    assert "password of the Airflow connection 'ray_default'" in warning and "export RAY_AUTH_TOKEN_PATH=" in warning


def test_an_auth_disabled_cluster_says_so_and_kuberays_in_cluster_service_gets_a_port_forward() -> None:
    handle = ClusterHandle(backend="kuberay", name="r", owned=True, auth_mode="disabled",
                           dashboard_url="http://vp-r-1a2b-head-svc.ml.svc.cluster.local:8265",
                           extra={"namespace": "ml", "resource": "vp-r-1a2b"})
    env = ray_shell_env(handle, {})
    assert env.values == {"RAY_ADDRESS": handle.dashboard_url, auth.MODE_VAR: "disabled", auth.TOKEN_PATH_VAR: None,
                          auth.TOKEN_VAR: None}
    assert "kubectl port-forward -n ml svc/vp-r-1a2b-head-svc 8265:8265" in env.shell()
    # A note is one comment line, whatever the handle holds: it cannot end the comment and run a command.
    odd = ClusterHandle(backend="address", name="r", dashboard_url="http://127.0.0.1:8265", owned=False,
                        gcs_address="127.0.0.1:6379\ntouch /tmp/owned")
    assert all(line.startswith(("export ", "unset ", "# ")) for line in ray_shell_env(odd, {}).shell().splitlines())


# -- the command -------------------------------------------------------------------------------------------
def test_an_unknown_run_is_one_line_naming_the_run_and_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("VERL_PIPELINE_HOME", str(tmp_path))
    assert main(["cluster", "env", "--run-name", "nightly/42"]) == 2
    err = capsys.readouterr().err
    assert err == ("verl-pipeline: error: no cluster recorded for run 'nightly/42': run `verl-pipeline cluster up` "
                   "first\n")
    assert main(["cluster", "env", "--run-dir", str(tmp_path / "runs" / "nope")]) == 2
    assert "cluster.json" in capsys.readouterr().err
    assert main(["cluster", "status", "--run-dir", str(tmp_path)]) == 2
    assert "only `cluster env` reads a run directory" in capsys.readouterr().err


@pytest.mark.integration
def test_rays_own_cli_lists_a_job_and_reads_its_log_after_cluster_env(
        tmp_path: Path, ray_cluster: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The seed's ``ray job list`` / ``ray job logs`` on the session's token-auth cluster, as a user types them
    after ``eval "$(verl-pipeline cluster env …)"``; the wait task's "where to look" command runs as printed."""
    from verl_pipeline.airflow.triggers import RayJobTrigger

    monkeypatch.setenv("VERL_PIPELINE_HOME", str(tmp_path))
    run_name = "cli/env-check"
    spec = _spec(build_parser().parse_args(["cluster", "env", "--run-name", run_name]))
    RunDir(spec.run_dir).save_cluster(ray_cluster.to_dict())  # as `cluster up` records it
    token = ray_cluster.token()
    assert token and ray_cluster.auth_mode == "token"

    printed = []
    for flags in ([], ["--json"], ["--run-dir", str(spec.run_dir)]):
        assert main(["cluster", "env", "--run-name", run_name, *flags]) == 0
        out = capsys.readouterr()
        assert token not in out.out + out.err and str(ray_cluster.token_file) in out.out
        printed.append(out.out)
    assert printed[2] == printed[0]  # the run directory names the same cluster as the run's name

    job_id = f"cli-env-{os.getpid()}"
    client = ray_cluster.client()
    # The log has what the job printed, which its entrypoint (listed by `ray job list`) does not.
    client.submit(entrypoint="echo env-check-$((40 + 2))", submission_id=job_id, runtime_env={})
    deadline = time.monotonic() + 120
    while not (info := client.get_job(job_id)) or not info.status.is_terminal():
        assert time.monotonic() < deadline, f"job {job_id} did not end within 120 s"
        time.sleep(0.5)
    where = RayJobTrigger(cluster=ray_cluster.to_dict(), job_id=job_id, cursor_dir=str(spec.run_dir))._where(info)
    (where_cmd,) = re.findall(r"`([^`]*ray job logs [^`]*)`", where)

    # The shell of someone else's session: Ray's auth off, another cluster's token; the env replaces both.
    shell = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", auth.MODE_VAR: "disabled",
             auth.TOKEN_VAR: "0" * 64}
    # The wait task's command (eval, then `ray job logs`), then `ray job list` in the shell it set up.
    script = f"set -e\n{where_cmd}\nray job list\n"
    r = subprocess.run(["bash", "-c", script], env=shell, capture_output=True, text=True, timeout=300)
    both = r.stdout + r.stderr
    assert r.returncode == 0, both[-3000:]
    assert f"submission_id='{job_id}'" in both and "SUCCEEDED" in both  # ray job list
    assert "env-check-42" in both  # ray job logs
    assert token not in both
