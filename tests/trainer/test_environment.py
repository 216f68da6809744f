"""Which configuration needs which package on the nodes, and what a node's report misses (pure rules)."""

from __future__ import annotations

from typing import Any

import pytest

from verl_pipeline.trainer.environment import (
    REPORTED_VERSIONS,
    Needs,
    VerlPins,
    evaluate,
    installed_verl_pins,
    needs_for,
    read_verl_pins,
    transformers_problem,
)
from verl_pipeline.trainer.nodes.attention import SDPA_OVERRIDE, actor_attn_implementation

PINS = read_verl_pins([
    "transformers!=5.6.0,<5.11,>=5.5.3",
    'flash-attn==2.8.3; extra == "flash-attn-cu130torch211"',
    'vllm==0.24.0; extra == "vllm"',
    'transformers==5.9.0; extra == "vllm"',
    'sglang==0.5.12; extra == "sglang"',
    "not a requirement ((",
])


def _modules(settings: dict[str, Any]) -> dict[str, str]:
    return {n.module: n.fix for n in needs_for(settings, PINS).modules}


def test_verl_pins_are_read_from_its_metadata() -> None:
    assert PINS.transformers is not None and transformers_problem(PINS.transformers, "5.10.4") is None
    assert PINS.pin("flash-attn-cu130torch211", "flash-attn", "?") == "flash-attn==2.8.3"
    assert PINS.pin("vllm", "vllm", "?") == "vllm==0.24.0"
    assert PINS.pin("nope", "x", "fallback") == "fallback"
    # The verl installed here pins the same (0.9.1): the rules read it, nothing is hard-coded.
    installed = installed_verl_pins()
    assert installed.transformers and transformers_problem(installed.transformers, "5.6.0")
    assert installed.pin("flash-attn-cu130torch211", "flash-attn", "?").startswith("flash-attn==")


@pytest.mark.parametrize(("version", "bad"), [("5.10.4", False), ("5.5.3", False), ("5.6.0", True),
                                             ("5.11.0", True), ("4.57.1", True), (None, True)])
def test_transformers_range(version: str | None, bad: bool) -> None:
    problem = transformers_problem("!=5.6.0,<5.11,>=5.5.3", version)
    assert (problem is not None) is bad
    if bad:
        assert "transformers!=5.6.0,<5.11,>=5.5.3" in str(problem)
    assert transformers_problem(None, "1.0") is None


def test_rollout_engine_the_config_names() -> None:
    grpo = {"algorithm.adv_estimator": "grpo", "+actor_rollout_ref.model.override_config.attn_implementation": "sdpa"}
    assert set(_modules({**grpo, "actor_rollout_ref.rollout.name": "vllm"})) == {"vllm"}
    assert "vllm==0.24.0" in _modules({**grpo, "actor_rollout_ref.rollout.name": "vllm"})["vllm"]
    assert set(_modules({**grpo, "actor_rollout_ref.rollout.name": "sglang"})) == {"sglang"}
    assert "verl[sglang]" in _modules({**grpo, "actor_rollout_ref.rollout.name": "sglang"})["sglang"]
    assert set(_modules({**grpo, "actor_rollout_ref.rollout.name": "trtllm"})) == {"tensorrt_llm"}
    assert _modules({**grpo, "actor_rollout_ref.rollout.name": "unknown"}) == {}


def test_a_critic_always_needs_flash_attn_even_with_sdpa() -> None:
    for settings in ({}, {"algorithm.adv_estimator": "gae"}, {"algorithm.adv_estimator": "grpo", "critic.enable": True},
                     {"algorithm.adv_estimator": "gae", "+actor_rollout_ref.model.override_config.attn_implementation":
                      "sdpa"}):
        mods = _modules(settings)
        assert set(mods) == {"flash_attn"}, settings
        assert "flash-attn==2.8.3" in mods["flash_attn"] and "grpo" in mods["flash_attn"]
        assert SDPA_OVERRIDE not in mods["flash_attn"]  # sdpa cannot help a critic
    need = needs_for({}, PINS).modules[0]
    assert "load_valuehead_model" in need.why and need.package == "flash-attn"


def test_without_a_critic_flash_attn_is_needed_only_where_the_settings_name_it() -> None:
    grpo = {"algorithm.adv_estimator": "grpo"}
    # Left unset, the attention is decided for the nodes at submit (flash-attn where it runs, else sdpa).
    assert needs_for(grpo, PINS).modules == ()
    key = "actor_rollout_ref.model.override_config.attn_implementation"
    for prefix in ("", "+", "++"):
        assert _modules({**grpo, prefix + key: "sdpa"}) == {}
        assert _modules({**grpo, prefix + key: "eager"}) == {}
        named = needs_for({**grpo, prefix + key: "flash_attention_2"}, PINS).modules
        assert [n.module for n in named] == ["flash_attn"]
        assert "attn_implementation is flash_attention_2" in named[0].why and SDPA_OVERRIDE in named[0].fix
    assert _modules({**grpo, "actor_rollout_ref.model.override_config": {"attn_implementation": "sdpa"}}) == {}
    section = {"actor_rollout_ref.model": {"override_config": {"+attn_implementation": "flash_attention_2"}}}
    assert _modules({**grpo, **section}) == _modules({**grpo, key: "flash_attention_2"})
    fa3 = needs_for({**grpo, "+" + key: "flash_attention_3"}, PINS).modules
    assert [(n.module, n.package) for n in fa3] == [("flash_attn_interface", "flash-attn-3")]
    assert actor_attn_implementation({}) == "flash_attention_2"
    # GAE with the critic switched off is critic-free too.
    assert _modules({"algorithm.adv_estimator": "gae", "critic.enable": False, key: "sdpa"}) == {}


def test_a_critic_and_flash_attention_3_need_both() -> None:
    mods = _modules({"+actor_rollout_ref.model.override_config.attn_implementation": "flash_attention_3"})
    assert set(mods) == {"flash_attn", "flash_attn_interface"}
    assert SDPA_OVERRIDE not in mods["flash_attn_interface"]


def test_paths_the_job_reads() -> None:
    needs = needs_for({"data.train_files": ["/d/a.parquet", "/d/b.parquet"], "data.val_files": "/d/v.parquet",
                       "actor_rollout_ref.model.path": "/m/actor", "critic.model.path": "/m/actor",
                       "reward.reward_model.model_path": "hdfs://remote/rm", "algorithm.adv_estimator": "grpo",
                       "actor_rollout_ref.model.override_config.attn_implementation": "sdpa"}, PINS)
    assert needs.paths == (("data.train_files", "/d/a.parquet"), ("data.train_files", "/d/b.parquet"),
                           ("data.val_files", "/d/v.parquet"), ("actor_rollout_ref.model.path", "/m/actor"),
                           ("critic.model.path", "/m/actor"))
    # flash-attn is always looked for (it decides the attention path), with the versions the caches are keyed by.
    assert needs.request() == {"modules": ["flash_attn", "verl"],
                               "paths": {"data.train_files": "/d/b.parquet", "data.val_files": "/d/v.parquet",
                                         "actor_rollout_ref.model.path": "/m/actor", "critic.model.path": "/m/actor"},
                               "versions": list(REPORTED_VERSIONS)}


# -- evaluate: a node's report -> findings ------------------------------------------------------------

def _facts(*, cuda: str | None = "13.0", devices: int = 8, missing: tuple[str, ...] = (),
           transformers: str = "5.9.0", paths: dict[str, bool] | None = None) -> dict[str, Any]:
    mods = {m: ({"ok": False, "error": f"ModuleNotFoundError: No module named '{m}'"} if m in missing
                else {"ok": True, "version": "1"}) for m in ("verl", "vllm", "flash_attn")}
    return {"torch": {"version": "2.11.0+cu130" if cuda else "2.13.0+cpu", "cuda": cuda,
                      "cuda_available": bool(cuda and devices), "device_count": devices if cuda else 0},
            "modules": mods, "transformers": transformers, "verl_transformers": "!=5.6.0,<5.11,>=5.5.3",
            "paths": {p: {"exists": ok} for p, ok in (paths or {}).items()}}


def _node(node_id: str, *, gpus: float, cpus: float = 64, head: bool = False, facts: Any = None,
          error: str | None = None) -> dict[str, Any]:
    return {"node_id": node_id, "ip": "10.0.0.1", "is_head": head, "cpus": cpus, "gpus": gpus, "facts": facts,
            "error": error}


PPO = needs_for({"actor_rollout_ref.rollout.name": "vllm", "actor_rollout_ref.model.path": "/shared/m"}, PINS)


def _lines(needs: Needs, nodes: list[dict[str, Any]]) -> list[str]:
    return [f.line() for f in evaluate(needs, nodes) if f.blocking]


def test_a_complete_gpu_cluster_has_no_findings() -> None:
    ok = _facts(paths={"/shared/m": True})
    assert evaluate(PPO, [_node("a" * 32, gpus=8, head=True, facts=ok), _node("b" * 32, gpus=8, facts=ok)]) == []


def test_a_gpu_node_without_vllm_or_flash_attn_is_named_with_the_fix() -> None:
    bad = _facts(missing=("vllm", "flash_attn"), paths={"/shared/m": True})
    lines = _lines(PPO, [_node("a" * 32, gpus=8, head=True, facts=_facts(paths={"/shared/m": True})),
                         _node("b" * 32, gpus=8, facts=bad)])
    assert len(lines) == 2 and all(line.startswith("node 10.0.0.1 (worker bbbbbbbb)") for line in lines)
    assert "vllm=\"ModuleNotFoundError: No module named 'vllm'\"" in lines[0]
    assert "requirements/gpu.txt" in lines[0] and "vllm==0.24.0" in lines[0]
    assert "flash-attn=" in lines[1] and "flash-attn==2.8.3" in lines[1]


def test_a_cpu_only_head_of_a_gpu_cluster_needs_no_rollout_engine() -> None:
    head = _facts(cuda=None, missing=("vllm", "flash_attn"), paths={"/shared/m": True})
    worker = _facts(paths={"/shared/m": True})
    assert evaluate(PPO, [_node("h" * 32, gpus=0, head=True, facts=head), _node("w" * 32, gpus=8, facts=worker)]) == []


def test_on_a_cluster_without_gpus_every_node_is_held_to_the_gpu_rules() -> None:
    cpu = _facts(cuda=None, missing=("vllm", "flash_attn"), paths={"/shared/m": True})
    lines = _lines(PPO, [_node("h" * 32, gpus=0, cpus=2, head=True, facts=cpu)])
    assert [line.split("=")[0].split(": ")[1] for line in lines] == ["torch", "vllm", "flash-attn"]
    assert "CPU build" in lines[0]


def test_missing_paths_versions_gpus_and_cpus() -> None:
    facts = _facts(paths={"/shared/m": False}, transformers="5.6.0", devices=4)
    lines = _lines(PPO, [_node("h" * 32, gpus=8, cpus=16, head=True, facts=facts)])
    assert any("actor_rollout_ref.model.path='/shared/m': does not exist on this node" in x for x in lines)
    assert any("transformers='5.6.0': verl supports transformers!=5.6.0,<5.11,>=5.5.3 only" in x for x in lines)
    assert any("torch sees 4 of the 8 GPU(s)" in x for x in lines)
    assert any("CPU=16.0: verl reserves 3 CPUs per GPU bundle: 8 GPU(s) need 24" in x for x in lines)
    broken = _facts(paths={"/shared/m": True})
    broken["torch"] = {"error": "OSError: libcudart.so.13: cannot open shared object file"}
    assert any("torch='OSError: libcudart.so.13" in x for x in _lines(PPO, [_node("h" * 32, gpus=8, facts=broken)]))
    no_verl = _facts(missing=("verl",), paths={"/shared/m": True}, transformers="4.0")
    assert [x.split(": ")[1].split("=")[0] for x in _lines(PPO, [_node("h" * 32, gpus=8, facts=no_verl)])] == ["verl"]


def test_a_node_that_did_not_answer_is_reported_but_is_not_the_users_error() -> None:
    ok = _facts(paths={"/shared/m": True})
    findings = evaluate(PPO, [_node("h" * 32, gpus=8, head=True, facts=ok),
                              _node("w" * 32, gpus=8, error="no answer within 5s")])
    assert [(f.node, f.what, f.blocking) for f in findings] == [("10.0.0.1 (worker wwwwwwww)", "probe", False)]
    assert "no answer within 5s" in findings[0].line()
    nobody = evaluate(PPO, [_node("h" * 32, gpus=8, error="the node died during the probe")])
    assert [f.what for f in nobody] == ["probe", "probe"] and not any(f.blocking for f in nobody)


def test_the_smoke_profiles_needs() -> None:
    """The embedded default trains PPO with a critic through vLLM: it needs vllm and flash-attn."""
    from verl_pipeline.profiles import build_run_spec
    from verl_pipeline.trainer.render import job_settings

    spec = build_run_spec({}, run_name="env/smoke")
    settings = job_settings(spec, train_files="/d/t.parquet", val_files="/d/v.parquet", model_path="/m")
    needs = needs_for(settings, VerlPins())
    assert {n.module for n in needs.modules} == {"vllm", "flash_attn"}
    assert ("critic.model.path", "/m") in needs.paths


def test_render_says_which_packages_the_gpu_nodes_need() -> None:
    from verl_pipeline.trainer.environment import render_notes

    ppo = render_notes(needs_for({"actor_rollout_ref.rollout.name": "vllm"}, PINS))
    engine = [n for n in ppo if n.startswith("needs vllm on every GPU node")]
    flash = [n for n in ppo if n.startswith("needs flash-attn on every GPU node")]
    assert len(engine) == 1 and "vllm==0.24.0" in engine[0]
    assert len(flash) == 1 and "requirements/gpu.txt does not install it" in flash[0] and "FLASH_ATTN=build" in flash[0]
    sdpa = {"algorithm.adv_estimator": "grpo", "+actor_rollout_ref.model.override_config.attn_implementation": "sdpa"}
    assert not [n for n in render_notes(needs_for(sdpa, PINS)) if n.startswith(("needs vllm", "needs flash-attn"))]


def test_renders_needs_name_everything_the_probe_checks() -> None:
    """Each kind of finding the probe can report (a node missing everything; a cluster too small, too old)
    is named by one of render's ``# needs:`` lines, with the value the probe holds it to."""
    from verl_pipeline.cluster.base import ClusterStatus
    from verl_pipeline.profiles import build_run_spec
    from verl_pipeline.spec import Mode
    from verl_pipeline.steps import cluster_problems
    from verl_pipeline.trainer.environment import render_notes

    notes = "\n".join(render_notes(PPO, n_gpus=8, settings={}))
    bare = _facts(cuda=None, missing=("verl", "vllm", "flash_attn"), paths={"/shared/m": False})
    wrong = _facts(devices=4, transformers="5.6.0", paths={"/shared/m": True})
    findings = evaluate(PPO, [_node("a" * 32, gpus=8, cpus=2, facts=bare), _node("b" * 32, gpus=8, cpus=2,
                                                                                  facts=wrong)])
    whats = {f.what for f in findings}
    assert whats == {"torch", "verl", "vllm", "flash-attn", "actor_rollout_ref.model.path", "CPU", "GPU",
                     "transformers"}, whats
    named = {"torch": "torch with CUDA", "GPU": "as many GPUs as Ray advertises", "CPU": "3 CPUs per GPU",
             "transformers": "transformers!=5.6.0,<5.11,>=5.5.3"}
    for what in whats:
        assert named.get(what, what) in notes, (what, notes)
    spec = build_run_spec({"nnodes": 1, "n_gpus_per_node": 8}, run_name="env/render")
    problems = cluster_problems(spec, ClusterStatus(True, 1, 2, 0, "2.40.0", "ok"), Mode.TRAIN)
    assert {p.key for p in problems} == {"cluster.ray_version", "cluster.CPU", "cluster.GPU"}
    cluster = next(n for n in render_notes(PPO, n_gpus=8, settings=spec.verl) if "cluster as a whole" in n)
    assert "Ray >= 2.41" in cluster and "8 GPU(s)" in cluster
    assert all(str(p.fix).split(">= ")[-1].split(" ")[0] in cluster for p in problems if p.key == "cluster.CPU")


def test_every_backend_accepts_the_probe_timeout_in_its_cluster_profile() -> None:
    from verl_pipeline.cluster.registry import get_backend
    from verl_pipeline.profiles import list_profiles, load_yaml_profile

    kinds = set()
    for name in list_profiles("clusters"):
        cluster = dict(load_yaml_profile("clusters", name)["cluster"])
        get_backend({**cluster, "probe_timeout_s": 120})
        kinds.add(cluster["backend"])
    assert kinds == {"local", "address", "slurm", "kuberay"}
