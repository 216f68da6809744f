"""The report's content from verl's metric rows and the run's attempts (pure)."""

from __future__ import annotations

import json

import pytest

from tests.report.rows import node_samples, verl_row
from verl_pipeline.jobs.gpu_usage import GpuReading, NodeGpuSample
from verl_pipeline.report import gpu
from verl_pipeline.report.build import (
    AttemptInfo,
    Report,
    RunFacts,
    RunOutcome,
    StepRow,
    build_report,
    merge_rows,
    preflight_checks,
)
from verl_pipeline.report.scaling_check import GPUS_NAMED, MIN_SAMPLES_JUDGED, FlagKind, ScalingPoint

FACTS = RunFacts(run_key="r2", run_name="verl_ppo/r2", profile="gsm8k", mode="train", nnodes=2, n_gpus_per_node=4,
                 total_steps=6, gpu_memory_gb=80)


def _attempts() -> list[AttemptInfo]:
    return [AttemptInfo(1, "job-a1", 1000.0, 0), AttemptInfo(2, "job-a2", 1100.0, 2)]


def test_a_resumed_run_counts_each_step_once_as_the_later_attempt_logged_it() -> None:
    # Attempt 1 reached step 3, its checkpoint was step 2: attempt 2 redid step 3 and went on to 6.
    rows = [verl_row(s, 1) for s in (1, 2, 3)] + [verl_row(s, 2, gen=1.0) for s in (3, 4, 5, 6)]
    merged = merge_rows(rows)
    assert [r.step for r in merged] == [1, 2, 3, 4, 5, 6]
    assert merged[2].attempt == 2
    report = build_report(FACTS, status=RunOutcome.SUCCEEDED, attempts=_attempts(), rows=rows, generated_at=2000.0,
                          ended_at=1000.0 + 3600)
    assert report.steps_done == 6
    assert [(a.attempt, a.resumed_from_step, a.first_step, a.last_step) for a in report.attempts] == [
        (1, 0, 1, 3), (2, 2, 3, 6)]
    assert report.steps_redone == 1
    # One hour on 8 GPUs.
    assert report.wall_time_s == 3600 and report.gpu_hours == pytest.approx(8.0)


def test_scores_throughput_and_timing_use_verls_names_and_meanings() -> None:
    rows = [verl_row(s, val=0.0) for s in range(1, 6)]
    rows[2].metrics["val-core/openai/gsm8k/reward/mean@1"] = 0.7
    rows[4].metrics["val-core/openai/gsm8k/reward/mean@1"] = 0.6
    rows[3].metrics["critic/score/mean"] = 0.9  # the best step is not the last
    report = build_report(FACTS, status=RunOutcome.SUCCEEDED, attempts=_attempts()[:1], rows=rows, generated_at=1.0)
    assert report.score is not None
    assert (report.score.final, report.score.best, report.score.best_step) == (pytest.approx(0.5), 0.9, 4)
    val = report.validation["val-core/openai/gsm8k/reward/mean@1"]
    assert (val.final, val.best, val.best_step) == (0.6, 0.7, 3)
    assert report.response_length is not None and report.response_length.final == 105.0
    # perf/throughput is per GPU; the run's total is verl's token count over its step time.
    assert report.throughput_per_gpu == pytest.approx(64000 / (6 * 8))
    assert report.throughput_total == pytest.approx(64000 / 6)
    assert report.time_per_step_s == 6.0
    assert report.timing_s == {"gen": 3.0, "old_log_prob": 0.5, "step": 6.0, "update_actor": 2.5}
    assert report.mfu_actor is None and report.peak_memory_allocated_gb is None


def test_median_keeps_the_first_steps_start_up_out_of_the_throughput() -> None:
    rows = [verl_row(1, step_s=60.0)] + [verl_row(s) for s in range(2, 6)]
    report = build_report(FACTS, status=RunOutcome.SUCCEEDED, attempts=_attempts()[:1], rows=rows, generated_at=1.0)
    assert report.throughput_per_gpu == pytest.approx(64000 / 48)


def test_mfu_and_peak_memory_under_the_names_verl_0_9_1_logs() -> None:
    """verl's trainers prefix the workers' ``perf/max_memory_*_gb`` with the role; the peak is the
    highest of every role's."""
    rows = [verl_row(s, **{"perf/mfu/actor": 0.3 + 0.01 * s, "actor/perf/max_memory_allocated_gb": 60.0 + s,
                           "actor/perf/max_memory_reserved_gb": 70.0 + s,
                           "critic/perf/max_memory_allocated_gb": 50.0,
                           "critic/perf/max_memory_reserved_gb": 75.0}) for s in (1, 2, 3)]
    report = build_report(FACTS, status=RunOutcome.SUCCEEDED, attempts=_attempts()[:1], rows=rows, generated_at=1.0)
    assert report.mfu_actor == pytest.approx(0.32)
    assert (report.peak_memory_allocated_gb, report.peak_memory_reserved_gb) == (63.0, 75.0)
    assert FlagKind.MEMORY_NEAR_LIMIT not in {f.kind for f in report.flags}  # 63 of 80 GB


def test_the_stand_in_trainers_rows_reach_the_memory_flag() -> None:
    """The rows the stand-in trainer logs (verl's names) give the peak, and near the GPU's memory, the flag."""
    from tests.fakes.fake_verl_trainer import step_metrics

    results = [{"score": 0.5, "length": 60.0}]
    rows = [StepRow(s, 1, step_metrics(s, 6.0, results, world=1, critic=False)) for s in (1, 2)]
    small_gpu = RunFacts("r3", "verl_ppo/r3", "smoke", "train", 1, 1, 2, gpu_memory_gb=2.1)
    report = build_report(small_gpu, status=RunOutcome.SUCCEEDED, attempts=_attempts()[:1], rows=rows,
                          generated_at=1.0)
    assert report.peak_memory_allocated_gb == pytest.approx(2.02)
    assert report.peak_memory_reserved_gb == pytest.approx(2.12)
    assert FlagKind.MEMORY_NEAR_LIMIT in {f.kind for f in report.flags}


def test_report_json_stores_what_a_later_run_compares_with() -> None:
    rows = [verl_row(s, gen=4.0) for s in (1, 2, 3)]
    earlier = [ScalingPoint("r1", 1, 4, 64000 / 24)]  # one node: twice this run's per-GPU throughput
    report = build_report(FACTS, status=RunOutcome.SUCCEEDED, attempts=_attempts()[:1], rows=rows, generated_at=5.0,
                          earlier=earlier)
    data = json.loads(json.dumps(report.to_dict()))
    assert data["status"] == "succeeded" and data["profile"] == "gsm8k" and data["mode"] == "train"
    assert data["scaling_point"] == {"run_key": "r2", "nnodes": 2, "n_gpus": 8, "throughput_per_gpu": 64000 / 48}
    assert [c["efficiency"] for c in data["comparisons"]] == [0.5]
    assert [f["kind"] for f in data["flags"]] == [FlagKind.GENERATION_DOMINATES.value, FlagKind.SCALING_FALLS.value]


def test_a_preflight_run_has_no_steps_and_shows_its_checks() -> None:
    summary = {"ok": True, "checks": {
        "verl_config": {"ok": True, "n_gpus": 1, "train_batch_size": 8, "rollout_n": 2},
        "data": {"ok": True, "train": {"rows": 64, "prompt_tokens": {"max": 90}}, "val": {"rows": 16}},
        "reward": {"ok": True, "train": {"scored": 64, "not_one": 0}, "val": {"scored": 16, "not_one": 0}},
        "generation": {"ok": True, "samples": [{}, {}]}}}
    facts = RunFacts("p1", "verl_ppo/p1", "smoke", "preflight", 1, 1, 3)
    report = build_report(facts, status=RunOutcome.SUCCEEDED, attempts=[AttemptInfo(1, "job", 10.0, 0)], rows=[],
                          generated_at=20.0, ended_at=40.0, preflight=summary)
    assert report.steps_done == 0 and report.gpu_hours is None and report.wall_time_s == 30.0
    assert report.notes == ["No training steps: this was a preflight run (the cluster has no GPUs); 4 of 4 checks "
                            "passed."]
    assert [(c.name, c.ok) for c in report.checks] == [("verl_config", True), ("data", True), ("reward", True),
                                                        ("generation", True)]
    assert "64 ground truths scored, 0 not 1.0" in report.checks[2].detail
    assert report.checks[1].detail == "train: 64 rows, prompt tokens ≤ 90; val: 16 rows"
    assert report.scaling_point is None and report.flags == []


def test_a_failed_check_shows_its_error() -> None:
    checks = preflight_checks({"checks": {"verl_config": {"ok": False, "error": "train_batch_size 7 not divisible"}}})
    assert [(c.name, c.ok, c.detail) for c in checks] == [("verl_config", False, "train_batch_size 7 not divisible")]


def test_a_failed_run_says_where_it_stopped_and_one_never_submitted_says_so() -> None:
    rows = [verl_row(s) for s in (1, 2)]
    failed = build_report(FACTS, status=RunOutcome.FAILED, attempts=_attempts()[:1], rows=rows, generated_at=1.0)
    assert failed.notes == ["The run failed at step 2 of 6."]
    never = build_report(FACTS, status=RunOutcome.FAILED, attempts=[], rows=[], generated_at=1.0)
    assert never.steps_done == 0 and never.wall_time_s is None
    assert never.notes == ["No training steps: no job was submitted (the run ended before its submit)."]


def test_validation_timed_outside_the_step_is_no_share_of_it() -> None:
    """verl times validation (``timing_s/testing``) after the step's timer: on the H200 run the phase
    shares added up to 128% when it was counted in. The step's own phases add up to at most 100%."""
    rows = [verl_row(s, **{"timing_s/testing": 2.0}) for s in (1, 2, 3)]
    report = build_report(FACTS, status=RunOutcome.SUCCEEDED, attempts=_attempts()[:1], rows=rows, generated_at=1.0)
    assert "testing" not in report.timing_s and report.timing_outside_step_s == {"testing": 2.0}
    assert report.phase_share == pytest.approx({"gen": 0.5, "old_log_prob": 0.5 / 6, "update_actor": 2.5 / 6})
    assert sum(report.phase_share.values()) <= 1.0


def test_phase_shares_stay_within_the_step_where_medians_would_not() -> None:
    """Medians of parts need not add up to the median of the whole (here 195%): the shares are of all
    steps' time."""
    rows = [verl_row(1, gen=9.5, step_s=10.0), verl_row(2, gen=0.0, step_s=10.0), verl_row(3, gen=9.5, step_s=20.0)]
    report = build_report(FACTS, status=RunOutcome.SUCCEEDED, attempts=_attempts()[:1], rows=rows, generated_at=1.0)
    medians = report.timing_s
    assert medians["gen"] + medians["update_actor"] + medians["old_log_prob"] == 1.95 * medians["step"]
    assert report.phase_share == pytest.approx({"gen": 19 / 40, "old_log_prob": 1.5 / 40, "update_actor": 19.5 / 40})
    assert sum(report.phase_share.values()) <= 1.0


def _validation_row(step: int, attempt: int, value: float) -> StepRow:
    """What verl logs before training (step 0) or when a resumed run starts: validation alone."""
    return StepRow(step, attempt, {"val-core/openai/gsm8k/reward/mean@1": value, "val-aux/num_turns/mean": 1.0})


def test_a_row_of_validation_alone_is_no_training_step() -> None:
    """verl's step-0 row (``val_before_train``) and a resumed attempt's row at the step it resumed
    from count in the validation series only: not as steps, step times or throughput."""
    rows = ([_validation_row(0, 1, 0.1)] + [verl_row(s, 1) for s in (1, 2, 3)]
            + [_validation_row(2, 2, 0.3)] + [verl_row(s, 2) for s in (3, 4)])
    report = build_report(FACTS, status=RunOutcome.FAILED, attempts=_attempts(), rows=rows, generated_at=1.0)
    assert report.steps_done == 4
    assert [(a.first_step, a.last_step) for a in report.attempts] == [(1, 3), (3, 4)]
    assert report.steps_redone == 1
    val = report.validation["val-core/openai/gsm8k/reward/mean@1"]
    assert (val.final, val.best, val.best_step) == (0.3, 0.3, 2)  # step 0's baseline and step 2's, by attempt 2
    # Step 2's training row is attempt 1's, with the validation attempt 2 ran there.
    step2 = merge_rows(rows)[2]
    assert step2.attempt == 1 and step2.metrics["timing_s/step"] == 6.0
    assert report.time_per_step_s == 6.0 and report.throughput_per_gpu == pytest.approx(64000 / 48)
    assert report.timing_s["step"] == 6.0 and sum(report.phase_share.values()) <= 1.0
    only_validation = build_report(FACTS, status=RunOutcome.FAILED, attempts=_attempts()[:1],
                                   rows=[_validation_row(0, 1, 0.1)], generated_at=1.0)
    assert only_validation.steps_done == 0 and only_validation.attempts[0].first_step is None
    assert only_validation.notes == ["No training steps: verl logged no step (the job ended before its first step)."]


def _trained(first_seen: float, last_row: float) -> list[AttemptInfo]:
    return [AttemptInfo(1, "job-a1", 1000.0, 0, first_step_seen_at=first_seen, last_row_at=last_row)]


def _gpus(*nodes: list[NodeGpuSample]) -> list[gpu.GpuSeries]:
    return gpu.collect(sample for node in nodes for sample in node)


def test_gpu_utilisation_is_judged_per_gpu_over_the_training_window_only() -> None:
    """Start-up (idle GPUs while models load) and the time after the last row are not judged; a GPU
    under 70% busy while the run trained is flagged by name, the busy ones are not."""
    busy = node_samples("aaaa1111ffff", "10.0.0.1", range(1000, 1500, 10), lambda t: 90.0 if 1100 <= t <= 1400 else 0.0)
    idle = node_samples("bbbb2222ffff", "10.0.0.2", range(1000, 1500, 10),
                        lambda t: (40.0 if t % 20 else 60.0) if 1100 <= t <= 1400 else 0.0,
                        used_mib=70_000.0)
    rows = [verl_row(s) for s in (1, 2, 3)]
    report = build_report(FACTS, status=RunOutcome.SUCCEEDED, attempts=_trained(1100.0, 1400.0), rows=rows,
                          generated_at=1.0, gpu_series=_gpus(idle, busy))
    assert [g.label for g in report.gpus] == ["10.0.0.1 GPU 0", "10.0.0.1 GPU 1", "10.0.0.2 GPU 0", "10.0.0.2 GPU 1"]
    first, _, third, fourth = report.gpus
    assert (first.samples, first.samples_in_window, first.node_ids) == (50, 31, ["aaaa1111ffff"])
    assert (first.mean_utilization_pct, first.median_utilization_pct, first.min_utilization_pct) == (90.0, 90.0, 90.0)
    assert third.mean_utilization_pct == pytest.approx((16 * 60 + 15 * 40) / 31)
    assert (third.median_utilization_pct, third.min_utilization_pct) == (60.0, 40.0)
    # Peak memory: the most the GPU used, over every sample.
    assert (fourth.peak_memory_used_mib, fourth.memory_total_mib) == (70_001.0, 81_920.0)
    (flag,) = [f for f in report.flags if f.kind is FlagKind.GPU_UTILIZATION_LOW]
    assert "2 of 4 GPU(s)" in flag.evidence and "10.0.0.2 GPU 1: 50% on average" in flag.evidence
    assert "10.0.0.1" not in flag.evidence
    assert "use_dynamic_bsz" in flag.remedy and "scaling.max_micro_batch_size_per_gpu" in flag.remedy
    data = json.loads(json.dumps(report.to_dict()))
    assert [(g["label"], g["uuid"]) for g in data["gpus"]][:2] == [("10.0.0.1 GPU 0", "GPU-10.0.0.1-0"),
                                                                  ("10.0.0.1 GPU 1", "GPU-10.0.0.1-1")]
    assert data["gpus"][3]["peak_memory_pct"] == pytest.approx(100 * 70_001 / 81_920)


def test_a_raylet_restart_leaves_one_row_per_physical_gpu() -> None:
    """Ray gives a restarted raylet a new node id: its GPUs are the same ones, by UUID, or (samples from
    before the UUID was recorded) by the node's address and the GPU's index."""
    for uuids in (True, False):
        before = node_samples("old-raylet", "10.0.0.1", range(1000, 1200, 10), lambda t: 90.0, n_gpus=1, uuids=uuids)
        after = node_samples("new-raylet", "10.0.0.1", range(1300, 1500, 10), lambda t: 80.0, n_gpus=1, uuids=uuids)
        report = build_report(FACTS, status=RunOutcome.SUCCEEDED, attempts=_trained(1000.0, 1500.0),
                              rows=[verl_row(1)], generated_at=1.0, gpu_series=_gpus(before, after))
        (one,) = report.gpus
        assert (one.label, one.node_ids, one.samples, one.mean_utilization_pct) == (
            "10.0.0.1 GPU 0", ["old-raylet", "new-raylet"], 40, 85.0)
    # A run that started before the UUID was recorded and went on after: one GPU, both halves.
    (merged,) = _gpus(node_samples("a", "10.0.0.1", [1.0, 2.0], lambda t: 50.0, n_gpus=1, uuids=False),
                      node_samples("b", "10.0.0.1", [3.0], lambda t: 50.0, n_gpus=1))
    assert (merged.uuid, list(merged.times), merged.node_ids) == ("GPU-10.0.0.1-0", [1.0, 2.0, 3.0], ["b", "a"])
    # Two containers of one host address, each with its own GPU at index 0: two GPUs, by UUID.
    two = _gpus([NodeGpuSample(1.0, "c1", "10.0.0.9", (GpuReading(0, 10.0, 1.0, 2.0, "GPU-aaa"),)),
                 NodeGpuSample(1.0, "c2", "10.0.0.9", (GpuReading(0, 20.0, 1.0, 2.0, "GPU-bbb"),))])
    assert [g.uuid for g in two] == ["GPU-aaa", "GPU-bbb"]


def test_gpus_busy_while_training_raise_no_flag_however_idle_the_start_up() -> None:
    samples = node_samples("aaaa1111", "10.0.0.1", range(1000, 1500, 10), lambda t: 75.0 if t >= 1100 else 0.0)
    report = build_report(FACTS, status=RunOutcome.SUCCEEDED, attempts=_trained(1100.0, 1400.0),
                          rows=[verl_row(s) for s in (1, 2)], generated_at=1.0, gpu_series=_gpus(samples))
    assert report.gpus[0].mean_utilization_pct == 75.0 and report.flags == []


def test_too_few_samples_in_the_training_window_are_not_judged() -> None:
    """One or two samples are instants, not an average: shown, not flagged."""
    def report_of(n_in_window: int) -> Report:
        times = [1000.0, *(1100.0 + 10.0 * i for i in range(n_in_window))]
        samples = node_samples("aaaa1111", "10.0.0.1", times, lambda t: 3.0, n_gpus=1)
        last = 1100.0 + 10.0 * (n_in_window - 1) + 5.0
        return build_report(FACTS, status=RunOutcome.SUCCEEDED, attempts=_trained(1100.0, last),
                            rows=[verl_row(s) for s in (1, 2)], generated_at=1.0, gpu_series=_gpus(samples))

    for n in range(1, MIN_SAMPLES_JUDGED):
        short = report_of(n)
        assert short.gpus[0].samples_in_window == n and short.gpus[0].mean_utilization_pct == 3.0
        assert short.flags == []
    (flag,) = report_of(MIN_SAMPLES_JUDGED).flags
    assert flag.kind is FlagKind.GPU_UTILIZATION_LOW and f"{MIN_SAMPLES_JUDGED} sample(s)" in flag.evidence


def test_no_training_window_no_gpu_judgement_and_no_readings_no_summary() -> None:
    """A run whose first step was never seen before its last row (or never came) shows its readings
    but judges no utilisation; a run without readings (a CPU cluster) has no GPU summary at all."""
    idle = node_samples("aaaa1111", "10.0.0.1", range(1000, 1500, 10), lambda t: 0.0, n_gpus=1)
    rows = [verl_row(1)]
    unseen = build_report(FACTS, status=RunOutcome.SUCCEEDED, attempts=_trained(1400.0, 1400.0), rows=rows,
                          generated_at=1.0, gpu_series=_gpus(idle))
    (one,) = unseen.gpus
    assert (one.samples, one.samples_in_window, one.mean_utilization_pct) == (50, 0, None)
    assert one.peak_memory_used_mib == 60_000.0 and unseen.flags == []
    none = build_report(FACTS, status=RunOutcome.SUCCEEDED, attempts=_trained(1100.0, 1400.0), rows=rows,
                        generated_at=1.0)
    assert none.gpus == [] and none.flags == []


def test_many_under_used_gpus_are_named_up_to_a_few_then_counted() -> None:
    nodes = [node_samples(f"n{k}", f"10.0.1.{k}", range(1100, 1400, 10), lambda t: 5.0, n_gpus=8) for k in range(8)]
    report = build_report(FACTS, status=RunOutcome.SUCCEEDED, attempts=_trained(1100.0, 1400.0),
                          rows=[verl_row(1)], generated_at=1.0, gpu_series=_gpus(*nodes))
    (flag,) = report.flags
    assert "64 of 64 GPU(s)" in flag.evidence and flag.evidence.endswith("; and 56 more")
    assert flag.evidence.count("on average") == GPUS_NAMED


def test_a_gradient_norm_that_stayed_0_is_flagged_with_its_cause_and_remedy() -> None:
    """The H200 acceptance run exported the base model's weights: every reward 0, every advantage 0."""
    zero = {"actor/grad_norm": 0.0, "critic/advantages/min": 0.0, "critic/advantages/max": 0.0}
    rows = [_validation_row(0, 1, 0.0)] + [verl_row(s, **zero) for s in (1, 2, 3, 4)]
    report = build_report(FACTS, status=RunOutcome.SUCCEEDED, attempts=_attempts()[:1], rows=rows, generated_at=1.0)
    (flag,) = report.flags[-1:]
    assert flag.kind is FlagKind.GRAD_NORM_ZERO
    assert "actor/grad_norm was 0 at all 4 training step(s) and every advantage was 0" in flag.evidence
    assert "same reward" in flag.evidence and "random model" in flag.evidence
    for knob in ("actor_rollout_ref.actor.entropy_coeff", "actor_rollout_ref.actor.optim.lr", "easier reward",
                 "actor_rollout_ref.rollout.n"):
        assert knob in flag.remedy
    assert (report.grad_norm_median, report.grad_norm_max) == (0.0, 0.0)


@pytest.mark.parametrize("grad_norms", [[0.0, 0.0, 0.3], [0.5, 0.5, 0.5]])
def test_a_gradient_that_moved_at_any_step_raises_no_flag(grad_norms: list[float]) -> None:
    rows = [verl_row(s, **{"actor/grad_norm": g}) for s, g in enumerate(grad_norms, start=1)]
    report = build_report(FACTS, status=RunOutcome.SUCCEEDED, attempts=_attempts()[:1], rows=rows, generated_at=1.0)
    assert FlagKind.GRAD_NORM_ZERO not in {f.kind for f in report.flags}
    assert report.grad_norm_max == max(grad_norms)


def test_a_run_that_logged_no_gradient_norm_is_not_judged() -> None:
    rows = [StepRow(s, 1, {k: v for k, v in verl_row(s).metrics.items() if k != "actor/grad_norm"}) for s in (1, 2)]
    report = build_report(FACTS, status=RunOutcome.SUCCEEDED, attempts=_attempts()[:1], rows=rows, generated_at=1.0)
    assert report.grad_norm_median is None and report.flags == []


def test_the_stand_in_trainer_logs_a_zero_gradient_when_every_reward_is_equal() -> None:
    """The stand-in logs verl's actor/grad_norm; equal rewards (no advantage) give 0 and the flag."""
    from tests.fakes.fake_verl_trainer import step_metrics

    def report_of(results: list[dict[str, float]]) -> list[FlagKind]:
        rows = [StepRow(s, 1, step_metrics(s, 6.0, results, world=1, critic=False)) for s in (1, 2)]
        return [f.kind for f in build_report(FACTS, status=RunOutcome.SUCCEEDED, attempts=_attempts()[:1],
                                             rows=rows, generated_at=1.0).flags]

    assert FlagKind.GRAD_NORM_ZERO in report_of([{"score": 0.0, "length": 60.0}, {"score": 0.0, "length": 70.0}])
    assert FlagKind.GRAD_NORM_ZERO not in report_of([{"score": 0.0, "length": 60.0}, {"score": 1.0, "length": 70.0}])

