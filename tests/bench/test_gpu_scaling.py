"""The scaling bench on the CPU (CI has no GPU): every configuration it would run builds the run spec its
provision would (the weak-scaled batch, the shape, the placement, its Ray nodes on their own GPUs), verl
accepts the multi-GPU shapes, the plan is printed without running anything, and the figures and the table
come out of verl's metric names and NCCL's lines as they should."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.bench import bench_script
from tests.trainer.nodes.probed import h200
from verl_pipeline.cluster.local import LocalBackend
from verl_pipeline.spec import Placement

REPO = Path(__file__).resolve().parents[2]
scaling = bench_script("gpu_scaling")
figures = bench_script("gpu_scaling_figures")
Config = scaling.Config


@pytest.fixture(scope="module")
def one_gpu_batches() -> dict[str, tuple[int, int]]:
    return {m: scaling.one_gpu_batch(m) for m in scaling.MODELS.values()}


def test_every_configuration_builds_the_spec_its_provision_would(tmp_path: Path,
                                                                 one_gpu_batches: dict[str, tuple[int, int]]) -> None:
    configs = scaling.every_config()
    assert len(configs) == len(set(configs)) == 56
    for c in configs:
        spec = scaling.run_spec(c, tmp_path)
        tbs, mini = one_gpu_batches[c.model_profile]
        want = (tbs * c.gpus, mini * c.gpus) if c.weak else (tbs, mini)  # the rules give one node one GPU's batch
        got = (spec.verl[scaling.BATCH_KEY], spec.verl[scaling.MINI_KEY])
        assert got == want, c.name
        assert (spec.nnodes, spec.n_gpus_per_node, spec.placement.value) == (c.nodes, c.gpus_per_node, c.placement)
        assert spec.verl[scaling.TP_KEY] == c.tp and spec.nccl_debug, c.name
        if c.placement == scaling.SEPARATE:  # rollout on one node of two, or half of one node's GPUs
            assert spec.pools is not None and spec.pools.rollout_nnodes == 1
            assert spec.placement is Placement.SEPARATE
        # Each Ray node of the run on GPUs of its own, as its provision starts them.
        nodes = LocalBackend.from_spec(spec.cluster).node_devices({})
        assert nodes == [",".join(str(g) for g in range(r * c.gpus_per_node, (r + 1) * c.gpus_per_node))
                         for r in range(c.nodes)], c.name


@pytest.fixture(scope="module")
def hydra_session() -> Iterator[None]:
    from verl_pipeline.trainer.validate import session

    with session():
        yield


#: The shapes no other test gives verl: two Ray nodes, a separate rollout pool on one node and across two
#: (with a critic too), rollout TP 2; each at 8 GPUs with the batch grown for them.
NEW_SHAPES = [Config("0.5b-grpo", 8, nodes=2), Config("0.5b-grpo", 8, placement=scaling.SEPARATE),
              Config("0.5b-grpo", 8, nodes=2, placement=scaling.SEPARATE), Config("0.5b-grpo", 8, tp=2),
              Config("0.5b-ppo", 8, nodes=2, placement=scaling.SEPARATE)]


@pytest.mark.parametrize("config", NEW_SHAPES, ids=lambda c: c.name)
def test_verl_accepts_the_new_shapes_as_decided_for_h200_nodes(config: Any, tmp_path: Path,
                                                               hydra_session: None) -> None:
    """With the job as the submit decides it for H200 nodes with flash-attn. ``--validate`` runs every
    configuration of every host size so (56, all accepted: docs/benchmarks.md); here the shapes alone, for
    the suite's time."""
    assert set(NEW_SHAPES) <= set(scaling.matrix(8))
    from verl_pipeline import steps
    from verl_pipeline.trainer.nodes.decisions import decide_for_spec
    from verl_pipeline.trainer.render import job_settings

    spec = scaling.run_spec(config, tmp_path)
    settings = job_settings(spec, train_files="/d/train.parquet", val_files="/d/val.parquet", model_path="/m")
    decision = decide_for_spec(spec, settings, scaling.h200_node(config.gpus_per_node))
    # The bench's H200 node decides the job's settings as a probe report of one does.
    probed = decide_for_spec(spec, settings, h200(gpus=config.gpus_per_node))
    assert (decision.settings, decision.attention) == (probed.settings, probed.attention)
    out = steps.validate_spec_with_verl(spec, decision=decision)  # raises ConfigError if verl refused it
    assert out["n_gpus"] == (4 if config.placement == scaling.SEPARATE else 8)


def test_the_two_node_split_is_written_into_the_cluster_profile(tmp_path: Path) -> None:
    split = Config("0.5b-grpo", 8, nodes=2)
    configs = scaling.write_run_configs(tmp_path / "split", split, range(8), [143771] * 8,
                                        cpus=scaling.cpus_per_node(split, 128, 8))
    prof = yaml.safe_load((configs / "clusters" / "local-gpu.yaml").read_text())
    assert {k: prof["cluster"][k] for k in ("backend", "nodes", "num_gpus", "num_cpus", "gpu_devices")} == {
        "backend": "local", "nodes": 2, "num_gpus": 4, "num_cpus": 64, "gpu_devices": list(range(8))}
    assert {k: prof["hardware"][k] for k in ("nnodes", "n_gpus_per_node", "cpus_per_node", "gpu_memory_gb")} == {
        "nnodes": 2, "n_gpus_per_node": 4, "cpus_per_node": 64, "gpu_memory_gb": 140}
    assert prof["runtime"]["nccl_debug"] is True
    assert LocalBackend.from_spec(prof["cluster"]).node_devices({}) == ["0,1,2,3", "4,5,6,7"]
    # A run beside others in a wave: its own GPUs of the host, and its share of the cores (at least verl's 13).
    one = Config("tiny-grpo", 2)
    configs = scaling.write_run_configs(tmp_path / "one", one, (5, 6), [143771] * 8,
                                        cpus=scaling.cpus_per_node(one, 16, 8))
    prof = yaml.safe_load((configs / "clusters" / "local-gpu.yaml").read_text())
    assert (prof["cluster"]["gpu_devices"], prof["cluster"]["num_cpus"]) == ([5, 6], 16)


def test_waves_give_each_run_gpus_of_its_own_and_sittings_keep_to_their_minutes() -> None:
    for gpus in scaling.GPU_COUNTS:
        configs = scaling.matrix(gpus)
        plan = scaling.waves(configs, list(range(gpus)))
        assert sorted((c for w in plan for c, _ in w.runs), key=scaling.order) == configs
        for w in plan:
            taken = [d for _, devices in w.runs for d in devices]
            assert len(taken) == len(set(taken)) <= gpus and {c.size for c, _ in w.runs} == {w.size}
            assert all(len(devices) == c.gpus for c, devices in w.runs)
        for group in scaling.sittings(plan, 27 * 60, None, False):
            cost = sum(w.seconds(None, False) for w in group)
            weights = scaling.WEIGHTS_S if any(w.size == "0.5b" for w in group) else 0.0
            assert len(group) == 1 or cost + weights <= 27 * 60
    assert all(len(w.runs) == 1 for w in scaling.waves(scaling.matrix(8), list(range(8)), serial=True))


def test_the_plan_names_every_configuration_its_gpus_and_minutes_and_runs_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert scaling.main(["--plan", "--gpus", "8", "--workdir", str(tmp_path / "work")]) == 0
    out = capsys.readouterr().out
    assert not (tmp_path / "work").exists()
    assert out.startswith("gpu_scaling plan: 8 GPU(s), 36 configuration(s) in ")
    for c in scaling.matrix(8):
        assert out.count(f" {c.name} ") == 1, c.name
    first = out.split("\nsitting 2:")[0]  # the weak-scaling series of the 0.5B GRPO profile, 1 to 8 GPUs
    assert "sitting 1: about 27 min (with 1.0 min writing the 0.5B weights): python bench/gpu_scaling.py " \
           "--gpus 8 --sitting 1 --out OUT" in first
    for name, gpus in (("0.5b-grpo-1x1-tp1-colocated", "0 "), ("0.5b-grpo-1x8-tp1-colocated", "0,1,2,3,4,5,6,7")):
        assert f"    {name}" in first and f"GPUs {gpus}" in first.split(name)[1].splitlines()[0]
    # The one-GPU machine: the four model profiles on its GPU, one after another.
    assert scaling.main(["--plan", "--gpus", "1", "--only", "tiny-*"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("gpu_scaling plan: 1 GPU(s), 2 configuration(s) in 2 wave(s), 1 sitting")
    assert "--only 'tiny-*' --out OUT" in out and "tiny-ppo-1x1-tp1-colocated" in out
    assert scaling.main(["--plan", "--gpus", "1", "--sitting", "3"]) == 2
    assert "the plan has sittings 1 to 2" in capsys.readouterr().out


def test_without_a_gpu_a_run_says_so_and_exits_0(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'No devices were found' >&2\nexit 6\n")
    (fake / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{Path(sys.executable).parent}:/usr/bin:/bin")
    assert scaling.main(["--workdir", str(tmp_path / "work")]) == 0
    assert "no NVIDIA GPU on this machine" in capsys.readouterr().out
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 143771\n")  # one H200
    assert scaling.main(["--gpus", "8", "--workdir", str(tmp_path / "work")]) == 2
    assert "--gpus 8, but nvidia-smi lists 1 GPU(s) here" in capsys.readouterr().out
    assert not (tmp_path / "work").exists()


def _row(step: int, seconds: float, *, tokens: float, save: float = 0.0, sync: float = 0.0) -> dict[str, float]:
    return {"step": step, "timing_s/step": seconds, "timing_s/save_checkpoint": save, "perf/total_num_tokens": tokens,
            "timing_s/update_weights": sync, "timing_s/gen": seconds / 2, "perf/throughput": 1.0}


def test_step_figures_leave_out_the_warm_up_and_the_checkpoint_save() -> None:
    rows = [_row(1, 200.0, tokens=8e5), _row(2, 150.0, tokens=8e5, sync=3.0),
            _row(3, 160.0, tokens=8e5, save=10.0, sync=3.0)]
    f = figures.step_figures(rows, 4)
    assert (f["steps"], f["steady_steps"], f["step_s"]) == (3, 2, 150.0)
    assert f["tokens_per_s_per_gpu"] == round(8e5 / (150.0 * 4), 3)
    assert (f["sync_s"], f["sync_share"], f["phases_s"]["gen"]) == (3.0, 0.02, 77.5)
    assert figures.step_figures(rows[:1], 1)["step_s"] == 200.0  # one step: it is all there is


NCCL_LOG = """\
(WorkerDict pid=11) h200:11:11 [0] NCCL INFO NCCL version 2.27.3+cuda12.9
h200:11:11 [0] NCCL INFO Using network Socket
h200:11:11 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
h200:11:11 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] via P2P/CUMEM/read
h200:12:12 [0] NCCL INFO Channel 00/0 : 1[4] -> 0[0] [send] via NET/Socket/0
h200:13:13 [1] NCCL INFO Channel 00 : 2[2] -> 3[3] via SHM/direct/direct
h200:11:11 [0] NCCL INFO Init timings - ncclCommInitRankConfig: rank 0 nranks 2 total 0.53 (kernels 0.20, alloc 0.01)
h200:12:12 [0] NCCL INFO Init timings - ncclCommInitRankConfig: rank 1 nranks 2 total 1.25 (kernels 0.21, alloc 0.01)
vLLM INFO something else entirely
"""


def test_nccl_says_its_version_network_communicators_and_each_channels_transport() -> None:
    assert figures.nccl_summary(NCCL_LOG.splitlines()) == {
        "versions": ["2.27.3+cuda12.9"], "networks": ["Socket"], "communicator_ranks": 2, "init_s_max": 1.25,
        "transports": {"NET/Socket": 1, "P2P": 2, "SHM": 1}}


def _result(config: Any, *, step_s: float, tokens: float, ok: bool = True, gpus: list[dict[str, Any]] | None = None,
            ) -> dict[str, Any]:
    return {**config.to_dict(), "ok": ok, "figures": {"step_s": step_s, "tokens_per_s_per_gpu": tokens,
                                                      "own_gpus": gpus or [], "time_to_first_step_s": [300.0]}}


def test_the_table_judges_each_run_against_its_profiles_one_gpu_run() -> None:
    busy = [{"index": i, "mean_utilization_pct": 80.0, "peak_memory_gib": 120.5} for i in range(8)]
    results = [
        _result(Config("0.5b-grpo", 1), step_s=140.0, tokens=5000.0),
        _result(Config("0.5b-grpo", 8), step_s=150.0, tokens=4700.0, gpus=busy),
        _result(Config("0.5b-grpo", 8, nodes=2), step_s=175.0, tokens=4000.0,
                gpus=[*busy[:7], {"index": 7, "mean_utilization_pct": 55.0}]),
        _result(Config("0.5b-grpo", 8, weak=False), step_s=30.0, tokens=2900.0),
        _result(Config("tiny-grpo", 2), step_s=4.0, tokens=3000.0),  # no one-GPU run of its profile: not judged
    ]
    rows = {r["config"]: r for r in figures.table_rows(results)}
    spine = rows["0.5b-grpo-1x8-tp1-colocated"]
    assert (spine["efficiency"], spine["overhead_vs_1gpu"], spine["failing"]) == (0.94, 0.067, [])
    assert (spine["gpu_util_min_pct"], spine["peak_memory_gib_max"]) == (80.0, 120.5)
    split = rows["0.5b-grpo-2x4-tp1-colocated"]
    assert split["failing"] == ["efficiency 80% < 90%", "beyond the 1-GPU step 20% > 10%", "a GPU at 55% < 70%"]
    shipped = rows["0.5b-grpo-1x8-tp1-colocated-shipped-batch"]  # other work per GPU: no step comparison
    assert (shipped["efficiency"], shipped["overhead_vs_1gpu"]) == (0.58, None)
    assert rows["tiny-grpo-1x2-tp1-colocated"]["efficiency"] is None
    table = figures.render_table(list(rows.values()))
    assert "| 0.5b-grpo-1x8-tp1-colocated | 8 | — | 150.0 | 4,700 | 94% | — | 7% | 80 / 80% | 120.5 | 300 |" in table


def test_the_dag_params_of_a_run() -> None:
    conf = scaling.dag_conf(Config("0.5b-ppo", 4, tp=2), None, Path("/models/0.5b"), (256, 64))
    assert conf == {"profile": "gpu-scaling", "model_profile": "qwen2.5-0.5b-ppo", "mode": "train",
                    "total_training_steps": 2, "nnodes": 1, "n_gpus_per_node": 4, "placement": "colocated",
                    "verl_overrides": [scaling.LEARNING_SIGNAL, "data.train_batch_size=1024",
                                       "actor_rollout_ref.actor.ppo_mini_batch_size=256",
                                       "actor_rollout_ref.rollout.tensor_model_parallel_size=2"],
                    "model_source": "/models/0.5b"}
    shipped = scaling.dag_conf(Config("tiny-grpo", 2, nodes=2, weak=False), 3, Path("/models/0.5b"), (16, 8))
    assert shipped["verl_overrides"] == [scaling.LEARNING_SIGNAL] and "model_source" not in shipped
    assert (shipped["total_training_steps"], shipped["nnodes"], shipped["n_gpus_per_node"]) == (3, 2, 1)


def test_nccl_lines_come_from_the_session_logs_of_the_runs_stopped_cluster(tmp_path: Path) -> None:
    import json

    logs = tmp_path / "ray" / "session_2026-12-05_10-00-00_1" / "logs"
    logs.mkdir(parents=True)
    (logs / "worker-aa-01000000-11.out").write_text(NCCL_LOG)
    (logs / "raylet.out").write_text("no NCCL here\n")
    (logs / "events").mkdir()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "cluster.stopped.json").write_text(json.dumps({"extra": {"temp_dir": str(tmp_path / "ray")}}))
    assert figures.nccl_summary(scaling.nccl_lines(run_dir))["transports"] == {"NET/Socket": 1, "P2P": 2, "SHM": 1}
    assert list(scaling.nccl_lines(tmp_path / "no-run")) == []


def test_the_table_is_made_again_from_results_written_in_several_sittings(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    first, second = tmp_path / "sitting-1", tmp_path / "sitting-2"
    for folder, result in ((first, _result(Config("0.5b-grpo", 1), step_s=140.0, tokens=5000.0)),
                           (second, _result(Config("0.5b-grpo", 8), step_s=150.0, tokens=4500.0))):
        folder.mkdir()
        (folder / f"{result['config']}.json").write_text(json.dumps(result))
        (folder / "scaling.json").write_text(json.dumps({"rows": []}))  # a table written earlier: not a result
    assert scaling.main(["--table", str(first), str(second)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(" | ")[0] for line in out[2:]] == ["| 0.5b-grpo-1x1-tp1-colocated",
                                                           "| 0.5b-grpo-1x8-tp1-colocated"]
    assert "| 90% |" in out[3]
    # The JSON and the plot of tokens/s against GPUs (beside the ideal line) go beside the last sitting's results.
    rows = json.loads((second / "scaling.json").read_text())["rows"]
    assert [r["efficiency"] for r in rows] == [1.0, 0.9]
    assert (second / "scaling.png").read_bytes()[:4] == b"\x89PNG"


def test_a_runs_gpu_rows_are_its_own_gpus() -> None:
    rows = [{"index": i, "mean_utilization_pct": 0.0 if i > 1 else 90.0, "peak_memory_used_mib": 2048.0}
            for i in range(8)]
    assert [g["index"] for g in figures.own_gpus(rows, (0, 1))] == [0, 1]
    assert figures.own_gpus(rows, (0,))[0]["peak_memory_gib"] == 2.0
