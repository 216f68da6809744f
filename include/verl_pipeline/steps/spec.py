"""The run's spec at the start of a run: verl's own validation of its shape, and the frozen copy every
later task and attempt starts from (a changed parameter against it is refused in one line)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from verl_pipeline.exceptions import ConfigError
from verl_pipeline.rundir import RunDir
from verl_pipeline.spec import ModelSource, RunSpec
from verl_pipeline.trainer.nodes.decisions import Decision, decide_for_spec

if TYPE_CHECKING:  # pyarrow and numpy stay out of DAG parsing
    from verl_pipeline.profiles import Asked

log = logging.getLogger(__name__)


def validate_spec_with_verl(spec: RunSpec, *, record_in: RunDir | None = None, reuse: bool = False,
                            decision: Decision | None = None) -> dict[str, Any]:
    """Run verl's own composition + validation for the run's target shape, before any cluster.

    ``decision`` is what was decided for the nodes (:mod:`verl_pipeline.trainer.nodes.decisions`; the submit
    validates a training job's decided shape); without one, what is decided without a probe.

    verl's model config loads a tokenizer, so the built-in tiny model stands in for the run's
    model here (a seconds-long structural check of batch sizes, parallelism and keys). Each
    validation verl passes is kept on this machine (``trainer.validate.keep``); with ``reuse`` a
    configuration validated before (same overrides but the run's names and data, same verl
    installation) is not composed or validated again. With ``record_in`` (the provision task's run
    directory) the validation is recorded there: a preflight job whose overrides differ from these only
    in the data it was given (and whose model is the stand-in, as on the embedded default) trusts it
    instead of composing and validating again; any other job repeats the validation on the cluster
    with its real model.
    """
    import time
    from importlib.metadata import version

    from verl_pipeline.models.prefetch import prefetch
    from verl_pipeline.paths import pipeline_home
    from verl_pipeline.trainer import reward
    from verl_pipeline.trainer.overrides import render_overrides
    from verl_pipeline.trainer.render import job_settings
    from verl_pipeline.trainer.validate import ValidationRecord, earlier_record, keep, validate, validation_key

    t0 = time.monotonic()
    # The stand-in is read only here, so it lives in this machine's home, not on the cluster's storage.
    stand_in = prefetch(ModelSource("builtin", "tiny-qwen2"), pipeline_home() / "models").path
    settings = job_settings(spec, train_files="/placeholder/train.parquet", val_files="/placeholder/val.parquet",
                            model_path=stand_in)
    settings.update((decision or decide_for_spec(spec, settings)).settings)
    reward.check_manager(settings)  # verl's config accepts any name; its reward loop fails at the first step
    overrides = render_overrides(settings)
    key = validation_key(overrides)
    record, kept = earlier_record(key) if reuse else (None, None)
    reused = record is not None
    if record is not None:
        seconds = round(time.monotonic() - t0, 2)
        log.info("verl %s accepted this configuration for %d x %d GPU(s) before (%s, same verl installation, same "
                 "overrides but the run's names and data): not composed or validated again (%.1fs)",
                 record.verl_version, spec.nnodes, spec.n_gpus_per_node, kept, seconds)
    else:
        v = validate(overrides)
        seconds = v.seconds
        record = ValidationRecord.of(v, overrides, key)
        kept = keep(record)
        log.info("verl %s accepted the configuration for %d x %d GPU(s) in %.1fs (critic: %s, reference: %s)",
                 record.verl_version, spec.nnodes, spec.n_gpus_per_node, v.seconds, v.use_critic,
                 v.use_reference_policy)
    for line in record.unchecked:
        log.warning("verl's validation here left unchecked: %s", line)
    if record_in is not None:
        record_in.save_validation(record.to_dict())
        log.info("verl's validation recorded in %s (key %s): the preflight job trusts it for the same overrides "
                 "and verl installation", record_in.validation_file, record.key)
    return {"n_gpus": record.n_gpus, "use_critic": record.use_critic,
            "use_reference_policy": record.use_reference_policy, "seconds": seconds, "verl_version": version("verl"),
            "reused": str(kept) if reused else None, "unchecked": list(record.unchecked)}


def frozen_or(spec: RunSpec, asked: Asked | None = None, *, starts: str = "where the run starts") -> RunSpec:
    """The run's frozen spec when it has one (a retried provision, the CLI on a run already up), else ``spec``.

    Like Airflow keeps a run on the DAG version it started with, a run keeps the spec it started
    with: a retry two days in renders what the run started with, whatever ``configs/`` says by
    then (a difference is logged). A run that should use edited profiles is a new run.

    ``asked``: what the caller set explicitly (``spec`` was built from it). A value the frozen run does
    not have is refused, not dropped: a ConfigError naming each difference and the two ways out (a new
    run name, or the same value ``starts``: where this run is started). A DAG run's params are the same
    on every try, so they agree with the run they froze.
    """
    run_dir = RunDir(spec.run_dir)
    frozen = _frozen(run_dir)
    if frozen is None:
        return spec
    if asked is not None:
        _refuse_conflicts(asked.conflicts(spec, frozen), frozen, run_dir, starts)
    now, then = spec.to_dict(), frozen.to_dict()
    changed = sorted(k for k in set(now) | set(then) if now.get(k) != then.get(k))
    if changed:
        log.warning("Run %s: using its frozen spec %s; the profiles and params now differ in %s, which this run "
                    "ignores (start a new run to use them)", spec.run_name, run_dir.spec_file, ", ".join(changed))
    else:
        log.info("Run %s: using its frozen spec %s", spec.run_name, run_dir.spec_file)
    return frozen


def _refuse_conflicts(conflicts: dict[str, tuple[Any, Any]], frozen: RunSpec, run_dir: RunDir, starts: str) -> None:
    if not conflicts:
        return
    names = ", ".join(conflicts)
    asked = {name: now for name, (now, _) in conflicts.items()}
    had = ", ".join(f"{name}={then!r}" for name, (_, then) in conflicts.items())
    raise ConfigError(names, asked[names] if len(asked) == 1 else asked,
                      f"run {frozen.run_name!r} was started with {had} (frozen in {run_dir.spec_file}): a run keeps "
                      "what it started with",
                      f"a new run name to run with {names} as asked, or the same value(s) {starts}")


def freeze(spec: RunSpec) -> None:
    """Save ``spec`` (checked) as the run's frozen spec, unless the run has one already."""
    if _frozen(RunDir(spec.run_dir)) is None:
        RunDir(spec.run_dir).save_spec(spec.to_dict())
        log.info("Run %s: spec frozen in %s (every later task, retry and CLI command of this run reads it)",
                 spec.run_name, RunDir(spec.run_dir).spec_file)


def _frozen(run_dir: RunDir) -> RunSpec | None:
    """The run's frozen spec; None when it has none, or only the copy an earlier release wrote when it
    submitted (it has no ``sources``: never read back, and not enough to rebuild the spec from)."""
    if not run_dir.has_spec() or "sources" not in run_dir.spec_dict():
        return None
    return RunSpec.load(run_dir)


def load_frozen(run_dir: Path) -> RunSpec:
    """The frozen spec of the run in ``run_dir`` (what provision saved), logged as such."""
    spec = RunSpec.load(RunDir(run_dir))
    log.info("Run %s: frozen spec %s used (saved at provision; configs/ is not read again)", spec.run_name,
             RunDir(run_dir).spec_file)
    return spec
