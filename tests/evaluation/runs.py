"""Run directories as the pipeline leaves them, for the evaluation tests: the example task's run (profile
``repeat-digit`` on the local CPU cluster profile) frozen, preprocessed, rendered and saved by the
pipeline's own steps, with the tiny model as its actor and as its exported model; and a published
champion run of the same profile."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from verl_pipeline.constants import Mode
from verl_pipeline.rundir import RunDir
from verl_pipeline.spec import RunSpec

PROFILE = "repeat-digit"


def example_run(tiny_model_path: Path, *, run_name: str, exported: bool = True) -> RunSpec:
    """The example task's run under ``$VERL_PIPELINE_HOME``: its spec frozen, its validation rows written by
    the project's preprocess (the tiny model's tokenizer), its job rendered and saved (the reward file
    staged in its job_files), and (``exported``) the tiny model as its exported model."""
    from verl_pipeline import steps
    from verl_pipeline.data.preprocess import preprocess
    from verl_pipeline.profiles import build_run_spec

    spec = build_run_spec({"profile": PROFILE, "mode": Mode.PREFLIGHT.value}, run_name=run_name,
                          cluster_profile="local-cpu")
    steps.freeze(spec)
    data = preprocess(spec.data, spec.data_options, spec.data_root, tokenizer=str(tiny_model_path),
                      max_prompt_length=int(spec.verl["data.max_prompt_length"]))
    job = steps.render(spec, data=data.to_dict(), models={"actor": {"path": str(tiny_model_path)}},
                       mode=Mode.PREFLIGHT)
    steps.save_run_files(spec, job)
    if exported:
        shutil.copytree(tiny_model_path, RunDir(spec.run_dir).model_dir)
    return spec


def published_run(storage_root: Path, tiny_model_path: Path, *, run_key: str,
                  data_hash: str | None, profile: str = PROFILE) -> Path:
    """A succeeded run of ``profile`` that ``runs/latest/<profile>`` points to, with the tiny model
    exported (``model.json`` beside it) and, unless ``data_hash`` is None, an evaluation of rows of that hash."""
    from verl_pipeline import runs
    from verl_pipeline.models.export import ExportManifest
    from verl_pipeline.paths import write_json_atomic
    from verl_pipeline.scores import Engine, Evaluation

    run_dir = storage_root / "runs" / run_key
    run = RunDir(run_dir)
    shutil.copytree(tiny_model_path, run.model_dir)
    write_json_atomic(run.model_manifest_file, ExportManifest(
        run_key=run_key, run_name=f"pytest/{run_key}", profile=profile, step=2, checkpoint=str(run_dir / "ckpt"),
        world_size=1, model_dir=str(run.model_dir), data_hash=None, base_model_source="builtin:tiny-qwen2",
        base_model_revision=None, final_reward=None, files={}).to_dict())
    if data_hash is not None:
        run.save_evaluation(Evaluation(data_path="val.parquet", data_hash=data_hash, split="val",
                                       engine=Engine.TRANSFORMERS, sampling={}, models={}).to_dict())
    checkpoints = storage_root / "checkpoints" / run_key
    checkpoints.mkdir(parents=True, exist_ok=True)
    runs.record_run(run_dir=run_dir, run_key=run_key, run_name=f"pytest/{run_key}", profile=profile,
                    status=runs.RunStatus.SUCCEEDED, checkpoint_dir=checkpoints)
    runs.promote(storage_root, profile, run_dir)
    return run_dir


def home_for(tmp_path: Path) -> dict[str, str]:
    """The environment of a pipeline home of its own under ``tmp_path``."""
    return {**os.environ, "VERL_PIPELINE_HOME": str(tmp_path / "home")}


def verl_rows(path: Path, *, n: int = 2, ground_truth: bool = True) -> Path:
    """``n`` rows of the example task in verl's schema (chat messages, data_source, reward_model), or without
    a ground truth: held-out rows as a team would keep them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    digits = [str((3 + 4 * i) % 10) for i in range(n)]
    table = pa.table({
        "prompt": [[{"role": "user", "content": f"Repeat: {d}"}] for d in digits],
        "data_source": ["example/repeat-digit"] * n,
        "reward_model": [{"style": "rule", "ground_truth": d} if ground_truth else {"style": "rule"} for d in digits],
        "extra_info": [{"index": i} for i in range(n)]})
    pq.write_table(table, path)
    return path
