"""The GPU acceptance script's CPU path (CI has no GPU): it says why it cannot run and exits cleanly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.bench import bench_script

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_acceptance.py"


def _run(path_dirs: list[Path], tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": os.pathsep.join([*map(str, path_dirs), os.environ["PATH"]])}
    return subprocess.run([sys.executable, str(SCRIPT), "--workdir", str(tmp_path / "work"), *args], env=env,
                          capture_output=True, text=True, timeout=120)


def test_without_a_gpu_it_says_so_and_exits_0(tmp_path: Path) -> None:
    # An nvidia-smi that finds no device fails, as on a machine with the driver but no GPU.
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'No devices were found' >&2\nexit 6\n")
    (fake / "nvidia-smi").chmod(0o755)
    out = _run([fake], tmp_path, "--scenario", "ppo", "--twin")  # what gpu_all.sh's TINY_TWIN=1 passes
    assert out.returncode == 0, out.stderr
    assert "no NVIDIA GPU on this machine" in out.stdout
    assert not (tmp_path / "work").exists()


def test_with_a_gpu_but_no_gpu_stack_it_names_what_to_install(tmp_path: Path) -> None:
    # nvidia-smi's answer on a one-H200 machine; this CPU venv has no vLLM.
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 143771\n")
    (fake / "nvidia-smi").chmod(0o755)
    out = _run([fake], tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "1 GPU(s) but vllm" in out.stdout and "requirements/gpu.txt" in out.stdout


def test_the_cluster_profile_describes_this_machines_gpus(tmp_path: Path) -> None:
    gpu_acceptance = _bench()
    configs = gpu_acceptance.write_configs(tmp_path, [143771, 143771])
    prof = yaml.safe_load((configs / "clusters" / "local-gpu.yaml").read_text())
    assert prof["cluster"]["num_gpus"] == 2 and prof["hardware"]["n_gpus_per_node"] == 2
    assert prof["hardware"]["gpu_memory_gb"] == 140
    assert (configs / "profiles" / "gpu-acceptance.yaml").is_file()
    assert "caches" not in (prof.get("storage") or {})  # each run's own storage unless asked
    shared = gpu_acceptance.write_configs(tmp_path, [143771], caches=tmp_path / "caches")
    prof = yaml.safe_load((shared / "clusters" / "local-gpu.yaml").read_text())
    assert prof["storage"]["caches"] == str(tmp_path / "caches")


def test_overrides_given_on_the_command_line_reach_every_scenarios_dag_run() -> None:
    import argparse

    gpu_acceptance = _bench()
    args = argparse.Namespace(verl_override=["actor_rollout_ref.model.use_fused_kernels=true"],
                              gpu_memory_utilization=0.2)
    conf = gpu_acceptance.base_conf(args, 4)
    assert conf["verl_overrides"] == ["actor_rollout_ref.model.use_fused_kernels=true",
                                      "actor_rollout_ref.rollout.gpu_memory_utilization=0.2"]
    assert conf["total_training_steps"] == 4 and conf["mode"] == "train"


def _bench() -> Any:
    return bench_script("gpu_acceptance")


def test_the_model_profiles_vocabulary_is_the_models(tiny_model_path: Path) -> None:
    """The token budgets size the logits from ``model.vocab_size``: it must be the model's own."""
    import json

    from verl_pipeline.profiles import load_yaml_profile

    tiny = json.loads((tiny_model_path / "config.json").read_text())["vocab_size"]
    for name in ("tiny-grpo", "tiny-ppo"):
        assert load_yaml_profile("models", name)["model"]["vocab_size"] == tiny
    for name in ("qwen2.5-0.5b-grpo", "qwen2.5-0.5b-ppo"):  # the real-size scenario's architecture
        assert load_yaml_profile("models", name)["model"]["vocab_size"] == _bench().QWEN25_05B_ARCH["vocab_size"]


def test_cold_caches_cover_every_cache_a_job_keeps_warm(tmp_path: Path) -> None:
    from verl_pipeline.trainer.nodes.warmstart import CACHE_DIRS

    env = _bench().cold_caches(tmp_path)
    assert set(CACHE_DIRS) <= set(env) and all(v.startswith(str(tmp_path)) for v in env.values())


def test_a_checked_runs_checkpoints_make_room_for_the_next_run_but_its_tracker_stays(tmp_path: Path) -> None:
    for part in ("global_step_1/actor", "global_step_2/critic"):
        (tmp_path / part).mkdir(parents=True)
        (tmp_path / part / "model.pt").write_bytes(b"w")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2")
    _bench().free_checkpoints(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["latest_checkpointed_iteration.txt"]


def test_the_ppo_scenarios_train_the_critic_profile_with_a_learning_signal() -> None:
    import argparse

    g = _bench()
    conf = g.base_conf(argparse.Namespace(verl_override=[], gpu_memory_utilization=None), 6, ppo=True)
    assert conf["model_profile"] == "tiny-ppo" and conf["profile"] == "gpu-acceptance"
    assert f"{g.ENTROPY_COEFF}=0.01" in conf["verl_overrides"]


def test_a_zero_gradient_is_expected_only_without_an_entropy_bonus_and_with_every_advantage_0() -> None:
    """The 0.5B architecture's random weights score 0 everywhere and its profile has no entropy bonus: GRPO's
    advantages are 0 and so is the gradient (H200, 2026-12-05). Anything else with a zero gradient is broken."""
    g = _bench()
    grpo_05b = {g.ENTROPY_COEFF: "0"}
    zero = [{"critic/advantages/min": 0.0, "critic/advantages/max": 0.0, "step": s} for s in (1, 2)]
    assert g.zero_gradient_expected(grpo_05b, zero)
    assert g.zero_gradient_expected({}, zero)  # unset: verl's default, no bonus
    assert not g.zero_gradient_expected({g.ENTROPY_COEFF: "0.01"}, zero)  # the tiny profiles' bonus
    signal = [*zero, {"critic/advantages/min": -0.4, "critic/advantages/max": 0.9, "step": 3}]
    assert not g.zero_gradient_expected(grpo_05b, signal)
    assert not g.zero_gradient_expected(grpo_05b, [{"step": 1}])  # advantages not logged: nothing known


def _restored(losses: dict[int, float]) -> Any:
    g = _bench()
    result = g.Result("resume-ppo", figures={"critic_per_step": {s: {"critic/vf_loss": v}
                                                                 for s, v in losses.items()}})
    g.check_critic_restored(result, result.figures["critic_per_step"], 3)
    return result


def test_a_resumed_critic_is_told_from_one_started_again_by_its_loss() -> None:
    # The H200 run of 2026-12-04: restored, step 4 goes on from step 3. Started again: step 4 is back near step 1.
    assert _restored({1: 0.0204, 2: 0.0133, 3: 0.0096, 4: 0.0061}).ok
    again = _restored({1: 0.0204, 2: 0.0133, 3: 0.0096, 4: 0.0199})
    assert not again.ok and "started again" in again.failures[0]
    # A loss that never moved cannot tell the two apart: that is a failure too, not a pass.
    assert not _restored({1: 0.01, 2: 0.01, 3: 0.01, 4: 0.01}).ok
    assert not _restored({1: 0.1, 4: 0.2}).ok  # step 3 missing
    # The bare twin's restart is judged alike, and named in the failure.
    twin = _bench().Result("resume-ppo")
    _bench().check_critic_restored(twin, {1: {"critic/vf_loss": 0.0204}, 3: {"critic/vf_loss": 0.0096},
                                          4: {"critic/vf_loss": 0.0199}}, 3, who="bare")
    assert twin.failures[0].startswith("bare: the resumed critic's loss") and "bare_critic_restored" in twin.figures


def test_the_configs_it_writes_with_shared_caches_make_a_run_spec(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """What provision checks first (on 2026-12-04 the H200 runs failed there: the shared caches lay outside
    every shared mount): the scenario's profile builds a spec on a 16-core one-GPU machine."""
    from verl_pipeline.profiles import build_run_spec

    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    configs = _bench().write_configs(tmp_path, [143771], caches=tmp_path / "caches" / "resume-ppo")
    monkeypatch.setenv("VERL_PIPELINE_CONFIGS", str(configs))
    monkeypatch.setenv("VERL_PIPELINE_HOME", str(tmp_path / "resume-ppo" / "home"))
    spec = build_run_spec({"profile": "gpu-acceptance", "mode": "train", "model_profile": "tiny-ppo"}, run_name="r")
    assert spec.cache_root == tmp_path / "caches" / "resume-ppo"


def test_each_attempts_actor_starts_read_back_from_the_report_as_the_task_log_says_them() -> None:
    from tests.jobs.startup.test_actors import SUBMITTED, _task, _worker
    from verl_pipeline.jobs.startup import actors

    starts = actors.from_ray([_task("TaskRunner", "w0", asked=24, running=26, loaded=50, finished=50.1)],
                                   [_worker("w0", launch=24.5, ready=25.5)], SUBMITTED)
    report = {"attempts": [actors.to_record(starts), {"actors": None}]}
    assert _bench().actor_lines(report) == [
        ["TaskRunner x 1: asked 24 s after submission, ready at 50 s (waiting 1 s · process 1 s · class load 24 s · "
         "__init__ 0 s)"], None]


def test_the_rollout_against_actor_figures_are_the_names_verl_computes_them_under() -> None:
    """What judges a change to the rollout engine (its executor, its start after a resume): verl's own
    comparison of the rollout's and the actor's probabilities, read from the metrics under these names."""
    import torch
    from verl import DataProto
    from verl.utils.debug.metrics import calculate_debug_metrics

    from verl_pipeline.trainer import metrics

    torch.manual_seed(0)
    actor = torch.log_softmax(torch.randn(4, 8), dim=-1)
    batch = {"old_log_probs": actor, "responses": torch.zeros(4, 8, dtype=torch.long),
             "response_mask": torch.ones(4, 8, dtype=torch.long)}
    names = metrics.ROLLOUT_VS_ACTOR
    synced = calculate_debug_metrics(DataProto.from_dict({**batch, "rollout_log_probs": actor.clone()}))
    stale = calculate_debug_metrics(DataProto.from_dict({**batch, "rollout_log_probs": torch.full_like(actor, -2.0)
                                                         + 0.01 * torch.randn(4, 8)}))
    assert set(names) <= synced.keys() and set(names) <= stale.keys()
    pearson, diff = names
    assert synced[pearson] == pytest.approx(1.0) and synced[diff] == pytest.approx(0.0)
    assert stale[pearson] < 0.5 and stale[diff] > 0.01


def test_the_kill_skips_a_process_that_ended_since_the_listing_and_finds_the_training_worker() -> None:
    """A cluster process that exits between the listing and the read of its command line is passed over
    (the PPO resume scenario died of NoSuchProcess there on the H100, 2026-12-05), and the worker found."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    worker = subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep(60)", "ray::WorkerDict.__init__"])
    try:
        target = _bench().kill_target("worker", [gone.pid, os.getpid(), worker.pid])
        assert target is not None and target[0] == worker.pid and "WorkerDict" in target[1]
        assert _bench().kill_target("raylet", [gone.pid, os.getpid(), worker.pid]) is None
    finally:
        worker.kill()
        worker.wait()


def _resume_job(tmp_path: Path, *extra: str) -> Path:
    """A DAG run's job.json as the resume-ppo scenario leaves it: 6 steps, GAE, checkpoints of its own."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    overrides = [f"trainer.default_local_dir={tmp_path / 'dag-checkpoints'}", "trainer.experiment_name=dag",
                 "trainer.total_training_steps=6", "algorithm.adv_estimator=gae", "+fake.step_seconds=2", *extra]
    job = {"overrides": overrides, "runtime_env": {"env_vars": {"PYTHONPATH": str(REPO)}}}
    (run_dir / "job.json").write_text(json.dumps(job))
    return run_dir


#: The bare-verl stand-in (tests/fakes/bare_verl_trainer.py), run as the twin runs verl's trainer module.
BARE_STAND_IN = ("-m", "tests.fakes.bare_verl_trainer")


def test_a_resume_twin_kills_bare_verls_worker_after_the_checkpoint_and_its_restart_goes_on_from_it(
        tmp_path: Path) -> None:
    g = _bench()
    # The DAG's figures of the scenario: 30 s from its kill to the resubmission, then 45 s to the retry's first step.
    result = g.Result("resume-ppo", figures={"kill_to_resubmit_s": 30.0, "time_to_first_step_s": [60.0, 45.0]})
    g.add_resume_twin(result, tmp_path, _resume_job(tmp_path), ppo=True, trainer=BARE_STAND_IN)
    twin = result.figures["bare"]
    assert result.ok, (result.failures, twin)
    kill = twin["kill"]
    # Killed once step 3 was checkpointed and logged (a busy machine's poll may come a step late); the driver
    # fails at its next call to the worker, having saved the step it was in.
    assert kill["killed_at_step"] >= 3 and "WorkerDict" in kill["killed"][1] and kill["left_running"] == []
    assert twin["rc"] != 0 and kill["exit_after_kill_s"] is not None  # verl ended by itself, failing
    assert twin["resumed_from"] in (kill["killed_at_step"], kill["killed_at_step"] + 1) and twin["resumed_from"] < 6
    assert twin["steps"] == list(range(1, twin["resumed_from"] + 1))
    assert twin["restart_rc"] == 0 and twin["restart_steps"] == list(range(twin["resumed_from"] + 1, 7))
    assert "ActorDiedError" in (tmp_path / "bare" / "bare.log").read_text()
    assert "Resuming from" in (tmp_path / "bare" / "bare-restart.log").read_text()
    assert 0 < twin["kill_to_resumed_step_s"] < 60
    assert result.figures["kill_to_resumed_step_s"] == 75.0
    assert result.figures["recovery_delta_s"] == round(75.0 - twin["kill_to_resumed_step_s"], 1)
    restored = result.figures["bare_critic_restored"]["critic/vf_loss"]
    assert restored["step_1"] == pytest.approx(0.07)
    assert restored[f"step_{twin['resumed_from'] + 1}"] == pytest.approx(0.1 * 0.7 ** (twin["resumed_from"] + 1))
    assert not any((tmp_path / "bare" / "checkpoints").glob("global_step_*"))  # freed once timed


def test_a_resume_twin_ends_a_bare_verl_that_hangs_on_its_dead_worker_and_restarts_it(tmp_path: Path) -> None:
    g = _bench()
    result = g.Result("resume-ppo")
    # bare verl has no hang watch: the twin gives it exit_wait_s to end by itself, then ends it and restarts.
    g.add_resume_twin(result, tmp_path, _resume_job(tmp_path, "+fake.hang_on_dead_worker=true"), ppo=True,
                      trainer=BARE_STAND_IN, exit_wait_s=2.0)
    twin = result.figures["bare"]
    assert twin["kill"]["exit_after_kill_s"] is None and twin["kill"]["left_running"] == []
    assert twin["restart_rc"] == 0 and twin["restart_steps"][-1] == 6 and result.ok, result.failures
    # No DAG figures to compare with: none made up.
    assert "recovery_delta_s" not in result.figures


def test_a_bare_start_that_outlives_its_deadline_is_ended_with_its_workers(tmp_path: Path) -> None:
    """A hung twin must not take the rest of a device session: it is ended at its deadline, and said so."""
    import psutil

    g = _bench()
    overrides, env = g.bare_setup(tmp_path / "bare", _resume_job(tmp_path, "+fake.step_seconds=600"))
    # 15 s: time for the stand-in to start its worker on a busy machine (a second or two on a quiet one).
    start = g.start_bare(tmp_path / "bare", overrides, env, deadline_s=15.0, trainer=BARE_STAND_IN)
    assert start.timed_out and start.rc != 0 and start.rows == [] and start.seconds < 60
    assert not psutil.pid_exists(int((tmp_path / "bare" / "worker.pid").read_text()))  # its worker ended too

