"""Every shipped recipe passes its own preflight: the rows preprocessing accepts score 1.0 in the
preflight job, answered in the recipe's check_solution form, with verl's own reward manager."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from verl_pipeline.paths import configs_dir


def _rows(recipe: str, tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """A small raw dataset in the columns ``recipe`` maps, and the data options the profile gives."""
    if recipe == "math":
        rows = [{"problem": f"What is {i} + {i}?", "solution": f"Add them: $\\boxed{{{2 * i}}}$"} for i in range(40)]
        options: dict[str, Any] = {}
    elif recipe == "gsm8k":
        rows = [{"question": f"Tom has {i} apples and buys {i + 1} more. How many?",
                 "answer": f"{i} + {i + 1} = {2 * i + 1}\n#### {2 * i + 1}"} for i in range(40)]
        options = {}
    elif recipe == "generic":
        rows = [{"prompt": f"Name the number after {i}.", "answer": str(i + 1)} for i in range(40)]
        options = {}
    else:
        raise AssertionError(f"no rows for recipe {recipe}: add them here")
    path = tmp_path / f"{recipe}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, options


SHIPPED = sorted(p.stem for p in (configs_dir() / "recipes").glob("*.yaml") if p.stem != "verl")


def test_every_shipped_recipe_is_covered() -> None:
    """Rows in verl's schema (recipe verl) have their own preflight test (tests/data/test_verl_rows.py)."""
    assert SHIPPED == ["generic", "gsm8k", "math"]


@pytest.mark.integration
@pytest.mark.parametrize("recipe", SHIPPED)
def test_a_shipped_recipe_passes_its_own_preflight(recipe: str, own_configs: Path, tmp_path: Path,
                                                   tiny_model_path: Path, ray_cluster: Any) -> None:
    from verl_pipeline import steps
    from verl_pipeline.constants import Mode
    from verl_pipeline.profiles import build_run_spec
    from verl_pipeline.rundir import RunDir
    from verl_pipeline.trainer.render import render_job

    source, options = _rows(recipe, tmp_path)
    prof = yaml.safe_load((own_configs / "profiles" / "smoke.yaml").read_text())
    prof["data"] = {"source": str(source), "recipe": recipe, **options}
    (own_configs / "profiles" / "recipe.yaml").write_text(yaml.safe_dump(prof))
    spec = build_run_spec({"profile": "recipe", "total_training_steps": 1},
                          run_name=f"pytest/recipe-{recipe}-{os.getpid()}")
    data = steps.preprocess(spec, out_root=tmp_path / "data")
    job = render_job(spec, mode=Mode.PREFLIGHT, train_files=data.train_path, val_files=data.val_path,
                     model_path=str(tiny_model_path), length_filter=data.counts["length_filter"])
    client = ray_cluster.client()
    job_id = f"recipe-{recipe}-{os.getpid()}"
    client.submit(entrypoint=job.entrypoint, submission_id=job_id, runtime_env=job.runtime_env)
    deadline = time.monotonic() + 600
    while not (info := client.get_job(job_id)).status.is_terminal():
        assert time.monotonic() < deadline, client.logs(job_id)[-3000:]
        time.sleep(1)
    summary_file = RunDir(spec.run_dir).preflight_file
    assert info.status.value == "SUCCEEDED" and summary_file.is_file(), client.logs(job_id)[-3000:]
    scores = json.loads(summary_file.read_text())["checks"]["reward"]
    assert scores["ok"], scores
    assert scores["train"]["answer_form"] == yaml.safe_load(
        (own_configs / "recipes" / f"{recipe}.yaml").read_text())["check_solution"]
