"""The scaling check's rules, case by case (pure), and reading earlier runs' reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from verl_pipeline.report import scaling_check
from verl_pipeline.report.gpu import GpuUsage
from verl_pipeline.report.scaling_check import Comparison, FlagKind, ScalingPoint


def _point(key: str, nnodes: int, per_gpu: float) -> ScalingPoint:
    return ScalingPoint(key, nnodes, nnodes * 8, per_gpu)


def test_efficiency_is_the_larger_runs_per_gpu_throughput_over_the_smallers() -> None:
    assert scaling_check.efficiency(_point("a", 1, 1000), _point("b", 4, 950)) == pytest.approx(0.95)


def test_compare_takes_the_latest_earlier_run_at_each_other_node_count() -> None:
    current = _point("now", 2, 900)
    earlier = [_point("old1", 1, 2000), _point("new1", 1, 1000), _point("same", 2, 5000), _point("four", 4, 810)]
    out = scaling_check.compare(current, earlier)
    assert [(c.other_run_key, c.other_nnodes, c.efficiency) for c in out] == [("new1", 1, 0.9), ("four", 4, 0.9)]


def test_no_comparison_without_runs_at_other_node_counts() -> None:
    assert scaling_check.compare(_point("now", 2, 900), [_point("same", 2, 1000)]) == []


@pytest.mark.parametrize(("gen", "flagged"), [(3.1, True), (3.0, False), (1.0, False)])
def test_generation_dominates_above_half_the_step(gen: float, flagged: bool) -> None:
    flag = scaling_check.generation_flag({"step": 6.0, "gen": gen})
    assert (flag is not None) is flagged
    if flag:
        assert flag.kind is FlagKind.GENERATION_DOMINATES and "52% of a step" in flag.evidence
        assert "tensor_model_parallel_size" in flag.remedy and "gpu_memory_utilization" in flag.remedy
        assert "max_num_seqs" in flag.remedy


def test_no_generation_flag_without_verls_timing() -> None:
    assert scaling_check.generation_flag({}) is None and scaling_check.generation_flag({"gen": 5.0}) is None


def test_saves_flagged_over_a_quarter_of_the_time_with_the_save_freq_that_keeps_them_under_a_tenth() -> None:
    """The 0.5B PPO run on the H200 (2026-12-05): a save at every step, 15.5 s of about 35 s."""
    run = [(38.14, 14.82), (33.31, 15.50), (35.07, 16.23)]
    flag = scaling_check.saves_flag(run)
    assert flag is not None and flag.kind is FlagKind.SAVES_DOMINATE
    assert flag.evidence == ("checkpoint saves took 44% of the training steps' time (3 save(s) of 15.5 s (median) in "
                             "3 step(s) of 20 s without saving); saving every 8 steps (trainer.save_freq=8) would "
                             "keep saves under 10%")
    assert "trainer.save_freq" in flag.remedy
    # The same saves every 10 steps take 7% of the time: not flagged.
    assert scaling_check.saves_flag([(35.07, 15.5)] + [(19.6, 0.0)] * 9) is None
    # Saves of 26% of the time are; the suggestion is never "every step".
    flagged = scaling_check.saves_flag([(10.0, 2.6)] * 4)
    assert flagged is not None and "trainer.save_freq=4" in flagged.evidence
    assert scaling_check.saves_flag([(10.0, 2.5)] * 4) is None and scaling_check.saves_flag([]) is None


@pytest.mark.parametrize(("peak", "gpu", "flagged"), [(73.0, 80, True), (72.0, 80, False), (79.0, None, False),
                                                      (None, 80, False)])
def test_memory_near_the_limit_above_ninety_percent_of_the_gpu(peak: float | None, gpu: float | None,
                                                               flagged: bool) -> None:
    flag = scaling_check.memory_flag(peak, gpu)
    assert (flag is not None) is flagged
    if flag:
        assert flag.kind is FlagKind.MEMORY_NEAR_LIMIT and "offload" in flag.remedy


def test_falling_per_gpu_throughput_flags_the_worst_comparison_with_the_network_remedy() -> None:
    comparisons = [Comparison("one", 1, 1000, 4, 700, 0.7), Comparison("two", 2, 900, 4, 700, 0.85),
                   Comparison("eight", 8, 650, 4, 700, 0.93)]
    flag = scaling_check.scaling_flag(comparisons)
    assert flag is not None and flag.kind is FlagKind.SCALING_FALLS
    assert "at 4 nodes is 70% of that at 1 (run one)" in flag.evidence
    assert "NCCL_IB_HCA" in flag.remedy and "infiniband" in flag.remedy
    assert scaling_check.scaling_flag([Comparison("x", 1, 1000, 2, 950, 0.95)]) is None


def test_earlier_points_reads_only_the_profiles_successful_training_reports(tmp_path: Path) -> None:
    def report(key: str, **data: object) -> None:
        path = tmp_path / "runs" / key / "report" / "report.json"
        path.parent.mkdir(parents=True)
        base = {"profile": "p", "status": "succeeded", "mode": "train", "generated_at": 10.0,
                "scaling_point": {"run_key": key, "nnodes": 1, "n_gpus": 8, "throughput_per_gpu": 100.0}}
        path.write_text(json.dumps({**base, **data}))

    report("late", generated_at=30.0)
    report("early", generated_at=20.0)
    report("failed", status="failed")
    report("preflight", mode="preflight", scaling_point=None)
    report("other", profile="q")
    report("me")
    (tmp_path / "runs" / "broken" / "report").mkdir(parents=True)
    (tmp_path / "runs" / "broken" / "report" / "report.json").write_text("{not json")
    points = scaling_check.earlier_points(tmp_path, "p", report_file="report/report.json", exclude_run_key="me")
    assert [p.run_key for p in points] == ["early", "late"]


def _idle_gpu() -> GpuUsage:
    return GpuUsage("10.0.0.1", 0, "GPU-a", ["n1"], samples_in_window=8, samples=45, mean_utilization_pct=16.5,
                    median_utilization_pct=3.0, min_utilization_pct=0.0, peak_memory_used_mib=73560.0,
                    memory_total_mib=81559.0)


#: The 0.5B PPO job's settings on the fast path, as its job.json holds them (2026-12-05).
FAST_PATH = {"actor_rollout_ref.actor.use_dynamic_bsz": True, "actor_rollout_ref.model.use_remove_padding": True,
             "critic.model.use_remove_padding": True, "actor_rollout_ref.rollout.tensor_model_parallel_size": 1,
             "actor_rollout_ref.actor.fsdp_config.param_offload": False}


def test_an_idle_gpus_remedy_leaves_out_what_the_job_already_has() -> None:
    flag = scaling_check.gpu_utilization_flag([_idle_gpu()], FAST_PATH)
    assert flag is not None and flag.kind is FlagKind.GPU_UTILIZATION_LOW
    remedy = flag.remedy
    # Packed by tokens, without padding, TP 1, no offload: none of it asked for again, what it has named.
    for asked in ("use_dynamic_bsz=true with", "use_remove_padding=true;", "larger micro batches", "offload off",
                  "a smaller actor_rollout_ref.rollout.tensor_model_parallel_size"):
        assert asked not in remedy, asked
    assert ("This job already has actor_rollout_ref.actor.use_dynamic_bsz=true, "
            "actor_rollout_ref.model.use_remove_padding=true, "
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1") in remedy
    # What would still give the GPU more: larger token budgets, more KV cache, a loader that keeps up.
    assert "a larger actor_rollout_ref.actor.ppo_max_token_len_per_gpu" in remedy
    assert "gpu_memory_utilization" in remedy and "data.dataloader_num_workers" in remedy


def test_an_idle_gpus_remedy_asks_for_what_the_job_lacks_and_every_way_when_its_settings_are_unknown() -> None:
    slow = {"+actor_rollout_ref.actor.fsdp_config.param_offload": True,
            "actor_rollout_ref.rollout.tensor_model_parallel_size": 2}
    remedy = scaling_check.gpu_work_remedy(slow)
    assert "larger micro batches" in remedy and "use_dynamic_bsz=true with" in remedy
    assert "use_remove_padding=true" in remedy and "offload off" in remedy and "a smaller" in remedy
    assert "already has" not in remedy and "log_prob_max_token_len_per_gpu" not in remedy
    unknown = scaling_check.gpu_utilization_flag([_idle_gpu()])
    assert unknown is not None and unknown.remedy == scaling_check.gpu_work_remedy(None)
    assert "offload off" in unknown.remedy and "already has" not in unknown.remedy
    assert "larger micro batches" in unknown.remedy and "use_remove_padding=true" in unknown.remedy


def test_an_idle_gpus_remedy_says_when_the_trainers_peak_memory_left_room_for_larger_micro_batches() -> None:
    # The 0.5B GRPO job on one H100 (2026-12-05): 13.5 GB at its peak of 79.2 GB, budgets memory-bound by the rules.
    flag = scaling_check.gpu_utilization_flag([_idle_gpu()], FAST_PATH, peak_gb=13.49, gpu_memory_gb=79.2)
    assert flag is not None
    assert flag.remedy.endswith("what the scaling rules chose. The trainer's peak allocated memory was 13.5 GB of "
                                "the GPU's 79.2 GB (17%; the rollout's memory is freed while the actor trains): "
                                "larger micro batches fit")
    # Nothing said where the peak took half the GPU or more, where it is unknown, or where verl keeps the
    # rollout's memory while the actor trains (then the trainer's peak is not what is left).
    for peak, gpu_gb, settings in ((39.6, 79.2, FAST_PATH), (None, 79.2, FAST_PATH), (13.49, None, FAST_PATH),
                                   (13.49, 79.2, {**FAST_PATH, "actor_rollout_ref.rollout.free_cache_engine": False})):
        quiet = scaling_check.gpu_utilization_flag([_idle_gpu()], settings, peak_gb=peak, gpu_memory_gb=gpu_gb)
        assert quiet is not None and "peak allocated memory" not in quiet.remedy
    # The report's flags pass the run's peak and GPU memory on.
    found = scaling_check.flags(timing_s={}, peak_memory_gb=13.49, gpu_memory_gb=79.2, comparisons=[],
                          gpus=[_idle_gpu()], settings=FAST_PATH)
    assert any("larger micro batches fit" in f.remedy for f in found if f.kind is FlagKind.GPU_UTILIZATION_LOW)
