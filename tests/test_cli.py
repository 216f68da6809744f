"""``verl-pipeline`` by hand, as a user runs it: real subprocesses, real local Ray cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ray_processes, write_pooled_cluster

CLI = [sys.executable, "-m", "verl_pipeline"]


def run(*args: str, home: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "VERL_PIPELINE_HOME": str(home)}
    r = subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, timeout=600)
    if check:
        assert r.returncode == 0, f"{args}: rc={r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r


def test_render_json_for_a_large_shape(tmp_path: Path, own_configs: Path) -> None:
    import yaml

    # The 0.5B PPO profile's rules on the built-in model (no download): its size facts left out, taken from the
    # model's config.json (a profile that gives the 0.5B's would be refused: they contradict it).
    prof = yaml.safe_load((own_configs / "models" / "qwen2.5-0.5b-ppo.yaml").read_text())
    prof["model"] = {"source": "builtin:tiny-qwen2"}
    (own_configs / "models" / "tiny-as-0.5b-ppo.yaml").write_text(yaml.safe_dump(prof))
    # One batch of 32 x 256 prompts needs as many training rows (an epoch of fewer would have no step).
    run_prof = yaml.safe_load((own_configs / "profiles" / "smoke.yaml").read_text())
    run_prof["data"]["train_size"] = 256 * 33  # a few duplicates are dropped
    (own_configs / "profiles" / "smoke.yaml").write_text(yaml.safe_dump(run_prof))
    r = run("render", "--model-profile", "tiny-as-0.5b-ppo", "--nnodes", "32", "--n-gpus-per-node", "8",
            "--json", home=tmp_path)
    out = json.loads(r.stdout)
    assert out["mode"] == "train"
    assert out["settings"]["data.train_batch_size"] == 256 * 32
    assert out["settings"]["trainer.nnodes"] == 32
    assert out["entrypoint"].startswith("python -m verl.trainer.main_ppo ")
    assert "32 node(s)" in out["derived"]["data.train_batch_size"]
    assert out["spec"]["model_facts"]["hidden_size"] == 128 and out["spec"]["model_facts"]["estimated"]


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    r = run("render", "--nnodes", "3", "--n-gpus-per-node", "5", "--set", "data.train_batch_size=48",
            home=tmp_path, check=False)
    assert r.returncode == 2
    assert r.stderr.startswith("verl-pipeline: error: data.train_batch_size=48")
    assert len(r.stderr.strip().splitlines()) == 1
    r = run("status", home=tmp_path, check=False)
    assert r.returncode == 2 and "cluster up" in r.stderr


@pytest.mark.integration
def test_every_step_by_hand(tmp_path: Path) -> None:
    pre = json.loads(run("preprocess", "--json", home=tmp_path).stdout)
    assert Path(pre["train_path"]).is_file() and pre["counts"]["train_rows"] == 256
    fetched = json.loads(run("prefetch", "--json", home=tmp_path).stdout)
    assert (Path(fetched["actor"]["path"]) / "config.json").is_file()

    up = json.loads(run("cluster", "up", "--json", home=tmp_path).stdout)
    temp_dir = up["extra"]["temp_dir"]
    try:
        status = json.loads(run("cluster", "status", "--json", home=tmp_path).stdout)
        assert status["status"]["ready"] and status["status"]["cpus"] == 2
        sub = json.loads(run("submit", "--json", home=tmp_path).stdout)
        assert sub["action"] == "submitted" and sub["mode"] == "preflight"
        assert sub["environment"]["nodes"][0]["answered"] and not sub["environment"]["enforced"]
        logs = run("logs", "--follow", home=tmp_path).stdout
        assert "VERL_PIPELINE_PREFLIGHT_SUMMARY" in logs
        info = json.loads(run("status", "--json", home=tmp_path).stdout)
        assert info["status"] == "SUCCEEDED" and info["submission_id"] == sub["submission_id"]
        again = json.loads(run("submit", "--json", home=tmp_path).stdout)
        assert again["action"] == "already_succeeded"
        # Recorded like the DAG's submit task: a re-submit after a failure resumes from here.
        from verl_pipeline.rundir import RunDir

        (run_dir,) = [d for d in (tmp_path / "runs").iterdir() if d.is_dir() and not d.is_symlink()]
        assert [a.submission_id for a in RunDir(run_dir).attempts()] == [sub["submission_id"]]
    finally:
        down = json.loads(run("cluster", "down", "--json", home=tmp_path).stdout)
    assert down["stopped_processes"] > 0
    assert ray_processes(temp_dir) == []
    assert run("cluster", "status", home=tmp_path, check=False).returncode != 0


def test_render_includes_every_model_of_the_run(tmp_path: Path, own_configs: Path) -> None:
    import yaml

    prof = yaml.safe_load((own_configs / "models" / "tiny-ppo.yaml").read_text())
    prof["model"]["reward_source"] = "builtin:tiny-qwen2"
    (own_configs / "models" / "tiny-ppo.yaml").write_text(yaml.safe_dump(prof))
    out = json.loads(run("render", "--json", "--no-verl-check", home=tmp_path / "home").stdout)
    assert any(o.startswith("reward.reward_model.model_path=") for o in out["overrides"]), out["overrides"]


def test_render_says_a_shared_clusters_run_queues_in_its_pool(tmp_path: Path, own_configs: Path) -> None:
    write_pooled_cluster(own_configs, "shared_gpus")
    out = run("render", "--no-verl-check", "--cluster-profile", "shared", "--n-gpus-per-node", "4",
              home=tmp_path / "home").stdout
    assert "# shared cluster: a verl_ppo run waits for 4 of the 8 slots of Airflow pool 'shared_gpus'" in out
    data = json.loads(run("render", "--json", "--no-verl-check", "--cluster-profile", "shared",
                          home=tmp_path / "home").stdout)
    assert data["spec"]["admission"] == {"pool": "shared_gpus", "slots": 8, "size": 8}
    # A shape the pool could never admit fails in one line, naming the key and the fix.
    r = run("render", "--no-verl-check", "--cluster-profile", "shared", "--nnodes", "2", home=tmp_path / "home",
            check=False)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert "clusters/shared.cluster.expected_gpus=8: the run needs 16 GPUs" in r.stderr + r.stdout


@pytest.mark.integration
def test_logs_follow_reads_each_byte_of_the_log_once(tmp_path: Path, ray_cluster: Any,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``logs --follow`` on a running job: only new bytes per poll, the whole log exactly once, then exit."""
    import itertools
    import re
    import shlex

    from verl_pipeline.cli import _spec, build_parser

    monkeypatch.setenv("VERL_PIPELINE_HOME", str(tmp_path))
    spec = _spec(build_parser().parse_args(["logs"]))
    spec.run_dir.mkdir(parents=True, exist_ok=True)
    (spec.run_dir / "cluster.json").write_text(json.dumps(ray_cluster.to_dict()))  # as `cluster up` records it
    job_id = f"cli-follow-{os.getpid()}"
    # The job writes for a few seconds, so --follow sees it running; the checks hold however the polls fall.
    code = ("import sys, time\nfor i in range(40):\n    print('line', i, 'é' * 50, flush=True)\n    time.sleep(0.1)")
    ray_cluster.client().submit(entrypoint=f"python -c {shlex.quote(code)}", submission_id=job_id, runtime_env={})
    r = run("-v", "logs", job_id, "--follow", home=tmp_path)
    log_file = Path(ray_cluster.extra["temp_dir"]) / "session_latest" / "logs" / f"job-driver-{job_id}.log"
    whole = log_file.read_text()
    assert r.stdout == whole and "line 39 " in whole
    info = ray_cluster.client().get_job(job_id)
    assert info is not None and info.status.value == "SUCCEEDED"  # --follow returned once the job ended
    # Each poll read from where the last one ended, and the reads add up to the file.
    reads = [(int(n), int(start)) for n, start in re.findall(r"(\d+) new log bytes from byte (\d+)", r.stderr)]
    assert reads and reads[0][1] == 0, r.stderr[-2000:]
    assert all(start == prev_start + prev_n for (prev_n, prev_start), (_, start) in itertools.pairwise(reads))
    assert sum(n for n, _ in reads) == len(whole.encode())


def test_render_decides_for_the_nodes_a_probe_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from tests.trainer.nodes.probed import h200
    from verl_pipeline.cli import main

    home = tmp_path / "home"
    monkeypatch.setenv("VERL_PIPELINE_HOME", str(home))
    args = ["render", "--profile", "gpu-acceptance", "--model-profile", "tiny-ppo", "--no-verl-check"]
    attn = "+actor_rollout_ref.model.override_config.attn_implementation"
    # No probe of the cluster on record: the run's own settings, and what submit would decide either way.
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "cluster local-gpu has no probe on record here" in text
    assert f"# decided at submit, with flash-attn on every GPU node: {attn}='flash_attention_2'" in text
    assert f"# decided at submit, without flash-attn on every GPU node: {attn}='sdpa'" in text
    assert "the probe refuses the run" in text  # tiny-ppo has a critic
    # --nodes: a run's environment.json (what its probe found).
    env = tmp_path / "environment.json"
    env.write_text(json.dumps({"found": h200().to_dict(), "nodes": []}))
    assert main([*args, "--json", "--nodes", str(env)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["decision"]["attention"] == "flash-attn" and f"{attn}=flash_attention_2" in out["overrides"]
    assert "actor_rollout_ref.actor.use_dynamic_bsz=true" in out["overrides"]
    assert out["runtime_env"]["env_vars"]["VLLM_DISABLE_COMPILE_CACHE"] == "0"
    # By default the cluster profile's latest probe on its storage (what the submit step keeps there).
    (home / "clusters").mkdir(parents=True)
    kept = {"run": "r", "nodes": h200(flash_attn=False).to_dict()}
    (home / "clusters" / "local-gpu.json").write_text(json.dumps(kept))
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "# decided for these nodes: attention: sdpa; fused log-prob kernels: True; warm caches: nvidia-h200" in text
    assert f"{attn}=sdpa" in text
    assert main([*args, "--nodes", str(tmp_path / "missing.json")]) == 2
    assert capsys.readouterr().err.startswith("verl-pipeline: error: --nodes ")
