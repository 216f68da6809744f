"""The run's own files: shipped with the job off shared storage, checked on every node on it."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from verl_pipeline.exceptions import ConfigError
from verl_pipeline.trainer import jobfiles
from verl_pipeline.trainer.environment import needs_for

TOOLS = "actor_rollout_ref.rollout.multi_turn.tool_config_path"
ADAPTER = "actor_rollout_ref.model.lora_adapter_path"
REWARD = "reward.custom_reward_function.path"


def test_files_off_shared_storage_ship_and_those_on_it_are_checked_on_every_node() -> None:
    settings = {REWARD: "/home/me/task/reward.py", TOOLS: "/mnt/shared/task/tools.yaml", ADAPTER: "/mnt/shared/lora",
                "data.train_files": "/mnt/shared/data/train.parquet"}
    files = jobfiles.plan(settings, ["/home/me/task/my_tools.py"], shared_roots=("/mnt/shared",), local=False)
    assert files.settings() == {REWARD: "reward.py"}
    assert [(s.key, s.source, s.name) for s in files.shipped] == [
        (REWARD, "/home/me/task/reward.py", "reward.py"), ("", "/home/me/task/my_tools.py", "my_tools.py")]
    assert files.checked == ((TOOLS, "/mnt/shared/task/tools.yaml"), (ADAPTER, "/mnt/shared/lora"))
    rendered = {**settings, **files.settings()}
    assert dict(needs_for(rendered).paths) == {
        "data.train_files": "/mnt/shared/data/train.parquet", TOOLS: "/mnt/shared/task/tools.yaml",
        ADAPTER: "/mnt/shared/lora"}  # the shipped reward is no path a node must have
    assert files.notes()[0] == (f"ships /home/me/task/reward.py with the job (runtime_env working_dir, as reward.py) "
                                f"for {REWARD}")


def test_two_shipped_files_of_one_name_are_refused() -> None:
    with pytest.raises(ConfigError, match=rf"{TOOLS}='/b/config.yaml': has the name of another file shipped with "
                                          r"the job \(/a/config.yaml\)"):
        jobfiles.plan({"reward.reward_manager.module.path": "/a/config.yaml", TOOLS: "/b/config.yaml"}, [],
                      shared_roots=(), local=True)


def test_an_adapter_off_shared_storage_is_refused_on_a_cluster_of_its_own_nodes() -> None:
    with pytest.raises(ConfigError, match=rf"{ADAPTER}='/home/me/lora': is not under a shared mount \['/mnt/shared'\]"):
        jobfiles.plan({ADAPTER: "/home/me/lora"}, [], shared_roots=("/mnt/shared",), local=False)
    assert jobfiles.plan({ADAPTER: "/home/me/lora"}, [], shared_roots=(), local=True).checked == (
        (ADAPTER, "/home/me/lora"),)


def _own_profile(configs: Path, **extra: Any) -> str:
    prof = yaml.safe_load((configs / "profiles" / "smoke.yaml").read_text())
    prof.update(extra)
    (configs / "profiles" / "own.yaml").write_text(yaml.safe_dump(prof))
    return "own"


def test_a_missing_file_is_refused_when_the_run_is_built(own_configs: Path) -> None:
    from verl_pipeline.profiles import build_run_spec

    missing = rf"{TOOLS}='task/tools.yaml': no such file \({own_configs}/task/tools.yaml\)"
    with pytest.raises(ConfigError, match=missing):
        build_run_spec({"profile": "smoke"}, run_name="pytest/files", overrides={TOOLS: "task/tools.yaml"})
    with pytest.raises(ConfigError, match=r"job_files\[0\]='gone.py': no such file"):
        build_run_spec({"profile": _own_profile(own_configs, job_files=["gone.py"])}, run_name="pytest/files")


def test_render_ships_a_tool_config_beside_the_configs_and_names_it(own_configs: Path, tiny_model_path: Path) -> None:
    from verl_pipeline.constants import Mode
    from verl_pipeline.profiles import build_run_spec
    from verl_pipeline.rundir import RunDir
    from verl_pipeline.trainer.render import render_job

    (own_configs / "task").mkdir()
    (own_configs / "task" / "tools.yaml").write_text("tools: []\n")
    (own_configs / "task" / "my_tools.py").write_text("X = 1\n")
    spec = build_run_spec({"profile": _own_profile(own_configs, job_files=["task/my_tools.py"])},
                          run_name="pytest/files", overrides={TOOLS: "task/tools.yaml"})
    assert spec.verl[TOOLS] == str(own_configs / "task" / "tools.yaml") and spec.job_files == (
        str(own_configs / "task" / "my_tools.py"),)
    job = render_job(spec, mode=Mode.TRAIN, train_files="/d/train.parquet", val_files="/d/val.parquet",
                     model_path=str(tiny_model_path))
    assert job.settings[TOOLS] == "tools.yaml" and f"{TOOLS}=tools.yaml" in job.overrides
    assert job.runtime_env["working_dir"] == str(RunDir(spec.run_dir).job_files_dir)
    assert [s.name for s in job.files.shipped] == ["tools.yaml", "my_tools.py"]


def _finished(client: Any, entrypoint: str, job_id: str, runtime_env: dict[str, Any]) -> Any:
    client.submit(entrypoint=entrypoint, submission_id=job_id, runtime_env=runtime_env)
    deadline = time.monotonic() + 600
    while not (info := client.get_job(job_id)).status.is_terminal():
        assert time.monotonic() < deadline, client.logs(job_id)[-3000:]
        time.sleep(1)
    return info


@pytest.mark.integration
def test_a_reward_file_only_on_the_airflow_side_reaches_a_two_node_cluster(
        own_configs: Path, tmp_path: Path, tiny_model_path: Path) -> None:
    """The preflight job on a real two-node local Ray cluster scores with a reward file that was deleted
    from where the user keeps it once the job's files were staged: the job has its own copy."""
    from verl_pipeline import steps
    from verl_pipeline.cluster.local import LocalBackend
    from verl_pipeline.constants import Mode
    from verl_pipeline.profiles import build_run_spec
    from verl_pipeline.rundir import RunDir
    from verl_pipeline.trainer.render import render_job

    mine = tmp_path / "home" / "task"
    mine.mkdir(parents=True)
    (mine / "reward.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(solution_str.strip() == 'yes ' + ground_truth and extra_info['id'].startswith('r'))\n")
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"Say {i}", "answer": str(i), "id": f"r{i}"}) + "\n"
                            for i in range(40)))
    prof = yaml.safe_load((own_configs / "profiles" / "smoke.yaml").read_text())
    prof["data"] = {"source": str(rows), "recipe": "generic", "data_source": "my/yes", "extra_columns": ["id"],
                    "check_solution": "yes {ground_truth}", "custom_reward_path": str(mine / "reward.py")}
    (own_configs / "profiles" / "yes.yaml").write_text(yaml.safe_dump(prof))
    spec = build_run_spec({"profile": "yes", "total_training_steps": 1}, run_name=f"pytest/files-{os.getpid()}")
    data = steps.preprocess(spec, out_root=tmp_path / "data")
    job = render_job(spec, mode=Mode.PREFLIGHT, train_files=data.train_path, val_files=data.val_path,
                     model_path=str(tiny_model_path), length_filter=data.counts["length_filter"])
    assert job.settings[REWARD] == "reward.py" and """--answer-form '"yes {ground_truth}"'""" in job.entrypoint
    steps.save_run_files(spec, job)
    (mine / "reward.py").unlink()
    backend = LocalBackend.from_spec({"backend": "local", "nodes": 2, "num_cpus": 1, "stop_grace_s": 3})
    handle = backend.provision(f"pytest/files-{os.getpid()}")
    try:
        client = handle.client()
        assert len([n for n in client.nodes() if n.alive]) == 2
        # The worker node's own copy first: two Ray nodes on one host share a session directory, and a node
        # unpacking a working_dir there replaces the folder a driver already runs in (nodes of a real cluster
        # have disks of their own). Both nodes then hold the same package, and the job runs in it.
        warm = _finished(client, "python -c \"import os, ray; ray.init(); print('ON-WORKER', ray.get(ray.remote("
                         "num_cpus=0, resources={'local_worker_node': 1})(lambda: os.path.isfile('reward.py'))"
                         ".remote()))\"", f"files-warm-{os.getpid()}", job.runtime_env)
        assert "ON-WORKER True" in client.logs(warm.submission_id), client.logs(warm.submission_id)
        job_id = f"files-{os.getpid()}"
        info = _finished(client, job.entrypoint, job_id, job.runtime_env)
        summary_file = RunDir(spec.run_dir).preflight_file
        assert info.status.value == "SUCCEEDED" and summary_file.is_file(), client.logs(job_id)[-3000:]
        summary = json.loads(summary_file.read_text())
        assert summary["ok"] and summary["cluster"]["nodes"] == 2, summary
        assert summary["checks"]["reward"]["train"]["not_one"] == 0
        assert summary["checks"]["reward"]["train"]["scored"] == data.counts["train_rows"]
    finally:
        backend.teardown(handle)
