"""The one place a job's node-dependent decisions are made: what it records, what a retry on other nodes
says, and the rendered job that carries it (pure, plus one read of a checkpoint folder)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.jobs.test_checkpoints import save
from tests.trainer.nodes.probed import CPU_MODEL, h200, probe_node
from verl_pipeline import steps
from verl_pipeline.constants import Mode
from verl_pipeline.profiles import build_run_spec
from verl_pipeline.spec import RunSpec
from verl_pipeline.trainer.nodes.attention import ACTOR_ATTN_OVERRIDE
from verl_pipeline.trainer.nodes.decisions import Decision, decide_for_spec
from verl_pipeline.trainer.nodes.facts import NodeFacts
from verl_pipeline.trainer.nodes.fastpath import DYNAMIC_BSZ_KEY, AttentionPath
from verl_pipeline.trainer.nodes.warmstart import COMPILE_CACHE_SWITCH, VAL_BEFORE_TRAIN_KEY
from verl_pipeline.trainer.render import job_settings, render_job


def _spec(model_profile: str = "tiny-ppo", **params: object) -> RunSpec:
    return build_run_spec({"profile": "gpu-acceptance", "model_profile": model_profile, **params}, run_name="decide")


def _decide(spec: RunSpec, nodes: NodeFacts, resume_step: int = 0) -> Decision:
    settings = job_settings(spec, train_files="/d/t.parquet", val_files="/d/v.parquet", model_path="/m")
    return decide_for_spec(spec, settings, nodes, resume_step=resume_step)


def test_the_record_says_what_the_probe_found_and_what_the_job_uses() -> None:
    decision = _decide(_spec(), h200())
    record = json.loads(json.dumps(decision.to_dict()))  # as job.json and decisions.jsonl keep it
    assert record["attention"] == "flash-attn" and record["settings"][ACTOR_ATTN_OVERRIDE] == "flash_attention_2"
    node = record["nodes"]["gpu_nodes"][0]
    assert (node["gpu_name"], node["gpu_memory_gb"], node["flash_attn"]) == ("NVIDIA H200", 139.8, "2.8.3.post2")
    # The CPUs beside the GPU: nothing is decided from them, but a run's figures compare only beside them.
    assert (node["cpus"], node["cpu_model"]) == (16, CPU_MODEL)
    assert "1 x NVIDIA H200 (139.8 GB, sm 9.0), 16 CPUs (AMD EPYC 9654 96-Core Processor), flash-attn" in \
        decision.nodes.describe()
    assert record["nodes"]["flash_attn_on_every_gpu_node"] is True and record["gpu_memory_gb"] == 139.8
    assert record["caches"]["enabled"] and record["env"][COMPILE_CACHE_SWITCH] == "0"
    assert record["rules"]["probe"].startswith("'ran' — the first submission probes the nodes; a restart probes")
    assert record["summary"].startswith("attention: flash-attn (flash_attention_2); dynamic batches: True (update ")
    # The record reads back as the same nodes (render --nodes, a retry's comparison).
    assert NodeFacts.from_dict(record["nodes"]) == decision.nodes
    # The cluster profile (local-gpu) says 80 GB: the difference is named, the nodes' memory used.
    assert any("139.8 GB per GPU, the cluster profile says 80 GB" in n for n in record["notes"])


def test_a_retry_on_other_nodes_decides_again_and_says_what_changed() -> None:
    spec = _spec("tiny-grpo")
    first = _decide(spec, h200()).to_dict()
    assert _decide(spec, h200()).changes_from(first) == []
    changes = _decide(spec, h200(flash_attn=False, node_id="b" * 56, ip="10.0.0.8")).changes_from(first)
    assert changes[0].startswith("other GPU nodes (1 -> 1; 10.0.0.8")
    assert "attention flash-attn -> sdpa" in changes
    assert any(c.startswith("settings ") and f"{ACTOR_ATTN_OVERRIDE}: 'flash_attention_2' -> 'sdpa'" in c
               and f"{DYNAMIC_BSZ_KEY}: True -> None" in c for c in changes)
    # Another driver on the new node: another cache folder.
    assert any(c.startswith("warm caches ") for c in _decide(spec, h200(driver="590.1")).changes_from(first))


def test_the_rendered_job_carries_the_decision_and_the_profiles_env_still_wins() -> None:
    spec = _spec("tiny-grpo")
    spec = RunSpec.from_dict({**spec.to_dict(), "runtime": {**spec.runtime, "env": {"TRITON_CACHE_DIR": "/mine"}}})
    settings = job_settings(spec, train_files="/d/t.parquet", val_files="/d/v.parquet", model_path="/m")
    decision = decide_for_spec(spec, settings, h200(), resume_step=2)
    job = render_job(spec, mode=Mode.TRAIN, train_files="/d/t.parquet", val_files="/d/v.parquet", model_path="/m",
                     decision=decision)
    assert f"{ACTOR_ATTN_OVERRIDE}=flash_attention_2" in job.overrides and f"{DYNAMIC_BSZ_KEY}=true" in job.overrides
    assert f"{VAL_BEFORE_TRAIN_KEY}=false" in job.overrides  # resumes from step 2: the model profile said true
    env = job.runtime_env["env_vars"]
    assert env["TRITON_CACHE_DIR"] == "/mine" and env["VLLM_CACHE_ROOT"] == str(spec.cache_root / str(
        decision.caches.key) / "vllm")
    assert job.decision["summary"] == decision.summary() and "resumes from step 2" in job.decision["summary"]
    assert "[decided at submit for the probed nodes]" in job.derived[DYNAMIC_BSZ_KEY]
    # Without a probe nothing is decided for nodes, and the job says so.
    plain = render_job(spec, mode=Mode.TRAIN, train_files="/d/t.parquet", val_files="/d/v.parquet", model_path="/m")
    assert plain.decision["attention"] == AttentionPath.UNDECIDED.value and "VLLM_CACHE_ROOT" not in \
        plain.runtime_env["env_vars"]
    assert not any(o.startswith(ACTOR_ATTN_OVERRIDE) for o in plain.overrides)


def test_the_decision_for_the_nodes_starts_from_the_runs_own_settings_not_the_unprobed_decision() -> None:
    # The job rendered before the probe (submit renders one for the probe's runtime_env) already has what is
    # known without a probe: an sdpa run's fused kernels. Decided again for the nodes, they are the rule's, not
    # "set explicitly".
    spec = _spec("tiny-grpo", verl_overrides=[f"{ACTOR_ATTN_OVERRIDE}=sdpa"])
    intent = render_job(spec, mode=Mode.TRAIN, train_files="/d/t.parquet", val_files="/d/v.parquet", model_path="/m")
    assert intent.settings["actor_rollout_ref.model.use_fused_kernels"] is True
    settings = intent.undecided_settings()
    assert "actor_rollout_ref.model.use_fused_kernels" not in settings and settings[ACTOR_ATTN_OVERRIDE] == "sdpa"
    decision = decide_for_spec(spec, settings, h200())
    assert decision.settings == {"actor_rollout_ref.model.use_fused_kernels": True}
    assert [r.key for r in decision.rules if r.overridden] == [ACTOR_ATTN_OVERRIDE]  # only the run's own sdpa


def test_the_kept_records_are_read_back_for_render() -> None:
    facts = h200().to_dict()
    for record in ({"found": facts}, {"decision": {"nodes": facts}}, {"nodes": facts, "attempt": 2},
                   {"run": "r", "nodes": facts}):
        found = NodeFacts.from_record(record, source="file.json")
        assert found is not None and found.gpu_nodes == h200().gpu_nodes and "as kept in file.json" in found.source
    # A record kept before the probe reported CPUs reads back without them.
    old_node = {k: v for k, v in facts["gpu_nodes"][0].items() if k not in ("cpus", "cpu_model")}
    older = NodeFacts.from_record({"found": {**facts, "gpu_nodes": [old_node]}}, source="older.json")
    assert older is not None and older.gpu_nodes[0].cpus is None and ", 16 CPUs" not in older.describe()
    # environment.json's own "nodes" is the per-node list, not the facts; an old file has no "found".
    assert NodeFacts.from_record({"nodes": [probe_node()]}, source="old.json") is None


def test_the_resume_point_is_read_as_the_submit_reads_it(tmp_path: Path) -> None:
    spec = build_run_spec({"profile": "gpu-acceptance", "model_profile": "tiny-grpo"}, run_name="resume/point")
    spec = RunSpec.from_dict({**spec.to_dict(), "storage_root": str(tmp_path)})
    settings = job_settings(spec, train_files="/d/t.parquet", val_files="/d/v.parquet", model_path="/m")
    assert steps.resume_point(spec, settings) == 0
    save(spec.checkpoint_dir, 3, world=1, critic=False)
    assert steps.resume_point(spec, settings) == 3
    save(spec.checkpoint_dir, 4, world=1, critic=False, skip=("actor/model_world_size_1_rank_0.pt",))
    assert steps.resume_point(spec, settings) == 3  # step 4 is incomplete: the attempt resumes from 3
