"""Several models per run: the model profile's critic/reward sources, the plan, and the mapped Airflow tasks."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.models.hub_server import FakeHub, Repo
from verl_pipeline.exceptions import ConfigError
from verl_pipeline.models.prefetch import plan_models, prefetch_run
from verl_pipeline.profiles import build_run_spec

REPO = Path(__file__).resolve().parents[2]
TOKEN = "hf_conn_secret_never_logged_456"


@pytest.fixture
def configs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of configs/ with a model profile whose critic and reward model come from the hub."""
    d = tmp_path / "configs"
    shutil.copytree(REPO / "configs", d)
    tiny = yaml.safe_load((d / "models" / "tiny-ppo.yaml").read_text())
    tiny["model"]["critic_source"] = "hf://acme/gated@main"
    tiny["model"]["reward_source"] = "hf://acme/gated@main"
    (d / "models" / "tiny-three.yaml").write_text(yaml.safe_dump(tiny))
    smoke = yaml.safe_load((d / "profiles" / "smoke.yaml").read_text())
    (d / "profiles" / "three-models.yaml").write_text(yaml.safe_dump({**smoke, "model_profile": "tiny-three"}))
    monkeypatch.setenv("VERL_PIPELINE_CONFIGS", str(d))
    return d


def test_plan_lists_distinct_models_with_their_roles(configs: Path) -> None:
    spec = build_run_spec({"profile": "three-models"}, run_name="t/plan")
    assert plan_models(spec) == [{"source": "builtin:tiny-qwen2", "roles": ["actor"]},
                                 {"source": "hf://acme/gated@main", "roles": ["critic", "reward"]}]
    assert spec.to_dict()["reward_model"] == "hf://acme/gated@main"
    assert plan_models(build_run_spec({}, run_name="t/plan")) == [{"source": "builtin:tiny-qwen2",
                                                                   "roles": ["actor"]}]


def test_bad_reward_source_is_a_config_error(configs: Path) -> None:
    prof = yaml.safe_load((configs / "models" / "tiny-three.yaml").read_text())
    prof["model"]["reward_source"] = "relative/dir"
    (configs / "models" / "tiny-three.yaml").write_text(yaml.safe_dump(prof))
    with pytest.raises(ConfigError, match=r"model\.reward_source='relative/dir'"):
        build_run_spec({"profile": "three-models"}, run_name="t/plan")


@pytest.fixture
def online_hub(tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    import huggingface_hub.constants as c

    with FakeHub() as hub:
        hub.repos["acme/gated"] = Repo.from_dir(tiny_model_path, token=TOKEN)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.setattr(c, "HF_HUB_OFFLINE", False)
        yield hub


def test_prefetch_run_fetches_each_model_once(configs: Path, online_hub: FakeHub, tmp_path: Path) -> None:
    spec = build_run_spec({"profile": "three-models"}, run_name="t/plan")
    out = prefetch_run(spec, token=TOKEN, cache_root=tmp_path)
    assert set(out) == {"actor", "critic", "reward"}
    assert out["critic"]["path"] == out["reward"]["path"] != out["actor"]["path"]
    assert len(online_hub.gets("model.safetensors")) == 1


def _xcoms(dag_run: Any, task_id: str) -> list[Any]:
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        rows = session.scalars(XComModel.get_many(run_id=dag_run.run_id, dag_ids=dag_run.dag_id, task_ids=task_id,
                                                  key="return_value")).all()
        return [XComModel.deserialize_value(r) for r in sorted(rows, key=lambda r: r.map_index)]


@pytest.mark.integration
def test_mapped_prefetch_tasks_with_the_hub_token_from_a_connection(
    configs: Path, online_hub: FakeHub, airflow_db: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture, tiny_model_path: Path,
) -> None:
    """plan_models → prefetch_model mapped over the run's two distinct models, in a real dag.test()."""
    from airflow.dag_processing.dagbag import BundleDagBag, sync_bag_to_db

    from verl_pipeline.models.prefetch import models_by_role

    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("AIRFLOW_CONN_HF_DEFAULT", json.dumps({"conn_type": "generic", "password": TOKEN}))
    monkeypatch.setenv("VERL_PIPELINE_HOME", str(tmp_path / "home"))
    # Only the two tasks under test, wired as dags/verl_ppo.py wires them; serialized like a real DAG file.
    folder = tmp_path / "dags"
    folder.mkdir()
    (folder / "prefetch_mapping_test.py").write_text(
        "from airflow.sdk import DAG, task\n"
        "from verl_pipeline import steps\n"
        "from verl_pipeline.airflow.operators import PlanModelsOperator, PrefetchModelOperator\n"
        "from verl_pipeline.airflow.operators.base import freeze_run, spec_from_params\n"
        "from verl_pipeline.airflow.params import build_params\n"
        "with DAG(dag_id='prefetch_mapping_test', schedule=None, params=build_params()) as dag:\n"
        "    @task(task_id='provision_ray_cluster')\n"
        "    def freeze(**context):  # what provision leaves for later tasks, without starting a cluster\n"
        "        freeze_run(context, steps.frozen_or(spec_from_params(context)))\n"
        "    plan = PlanModelsOperator(task_id='plan_models')\n"
        "    freeze() >> plan\n"
        "    PrefetchModelOperator.partial(task_id='prefetch_model', map_index_template='{{ model_label }}')"
        ".expand(model=plan.output)\n"
    )
    from airflow.dag_processing.bundles.manager import DagBundlesManager

    DagBundlesManager().sync_bundles_to_db()
    bag = BundleDagBag(dag_folder=str(folder), bundle_path=folder, bundle_name="dags-folder")
    assert bag.import_errors == {}
    sync_bag_to_db(bag, "dags-folder", None)
    dag = bag.dags["prefetch_mapping_test"]
    # The actor: a local directory (verified in place); critic and reward model: one gated hub model.
    dr = dag.test(run_conf={"profile": "three-models", "model_source": str(tiny_model_path)})
    states = {(ti.task_id, ti.map_index): str(ti.state) for ti in dr.get_task_instances()}
    assert str(dr.state) == "success", states
    assert states == {("provision_ray_cluster", -1): "success", ("plan_models", -1): "success",
                      ("prefetch_model", 0): "success", ("prefetch_model", 1): "success"}
    labels = {ti.map_index: ti.rendered_map_index for ti in dr.get_task_instances() if ti.task_id == "prefetch_model"}
    assert labels == {0: f"actor: {tiny_model_path}", 1: "critic+reward: hf://acme/gated@main"}
    models = models_by_role(_xcoms(dr, "prefetch_model"))
    assert set(models) == {"actor", "critic", "reward"}
    assert models["actor"]["path"] == str(tiny_model_path)
    assert Path(models["critic"]["path"]).is_relative_to(tmp_path / "home" / "models" / "hf")
    assert models["critic"]["commit"] == online_hub.repos["acme/gated"].commit
    assert TOKEN not in caplog.text
