"""The canary scanner itself: it finds a planted canary and a cluster's Ray token, and not a masked one."""

from __future__ import annotations

import json
from pathlib import Path

from tests.integration.secret_canary import connection_env, find_leaks, new_canaries, scan_text


def test_a_planted_canary_is_found_and_a_masked_one_is_not(tmp_path: Path) -> None:
    canaries = new_canaries()
    assert len(set(canaries.values())) == len(canaries) == 3
    logs, run = tmp_path / "logs", tmp_path / "runs" / "r1"
    (logs / "dag_id=verl_ppo" / "run_id=x").mkdir(parents=True)
    run.mkdir(parents=True)
    (logs / "dag_id=verl_ppo" / "run_id=x" / "attempt=1.log").write_text(
        f"token={canaries['hf_default.password']}\nmasked: ***\n")
    (run / "run_spec.json").write_text(json.dumps({"hub": "***"}))
    # A cluster whose token file exists: its token is searched for, the token file itself is not a leak.
    auth_dir, temp_dir = tmp_path / "vp-c.auth", tmp_path / "vp-c"
    auth_dir.mkdir()
    temp_dir.mkdir()
    (auth_dir / "ray_auth_token").write_text("f" * 64)
    (temp_dir / "dashboard.log").write_text("Authorization: Bearer " + "f" * 64)
    handle = {"name": "c", "token_file": str(auth_dir / "ray_auth_token"), "extra": {"temp_dir": str(temp_dir)}}

    leaks = find_leaks(canaries, log_dirs=[logs, auth_dir], run_dirs=[run], clusters=[handle])
    assert [str(leak) for leak in leaks] == [
        f"hf_default.password in {logs / 'dag_id=verl_ppo' / 'run_id=x' / 'attempt=1.log'}",
        f"ray token of c in {temp_dir / 'dashboard.log'}",
    ]
    (temp_dir / "dashboard.log").write_text("Authorization: ***")
    (logs / "dag_id=verl_ppo" / "run_id=x" / "attempt=1.log").write_text("token=***\n")
    assert find_leaks(canaries, log_dirs=[logs], run_dirs=[run], clusters=[handle]) == []


def test_the_connections_carry_every_canary() -> None:
    canaries = new_canaries()
    env = connection_env(canaries)
    assert set(env) == {"AIRFLOW_CONN_HF_DEFAULT", "AIRFLOW_CONN_RAY_DEFAULT", "AIRFLOW_CONN_KUBERNETES_DEFAULT"}
    assert all(scan_text(" ".join(env.values()), {k: v}, "env") for k, v in canaries.items())
