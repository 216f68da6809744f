"""How long a run trains: ``trainer.total_training_steps`` and ``trainer.total_epochs``, from the request and the data.

verl 0.9.1's trainer (``trainer/ppo/v1/trainer_base.py``) counts an epoch as ``len(train dataset) //
data.train_batch_size`` steps (its dataloader drops the last incomplete batch), trains
``total_training_steps`` steps when that is set and ``epochs x steps per epoch`` otherwise, and stops at the
end of ``total_epochs`` epochs (default 30) even before its steps are done: 500 steps on 64 rows in batches of
16 would end after 30 x 4 = 120 steps, without the save of the last step.

The pipeline therefore always renders both, by one rule (:func:`run_length`):

- the setting of the later layer wins (asked: a param, CLI flag, ``--set`` or ``verl_overrides`` > a profile >
  the default of one step); set in the same layer, the steps win, as they do in verl;
- epochs that win: steps = epochs x steps per epoch (the training rows preprocessing wrote, ``train_rows``);
- steps that win: the epochs cover them (``max(epochs given, steps)``: an epoch has at least one step), so the
  run ends at its last step and saves there;
- an epoch without a step (fewer training rows than a batch) is refused.

Which wins and why is the rule of both keys (``render``'s derived values, the submit's log); steps and epochs that
disagree with the data (several passes over it, or a setting that lost) say so in it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from verl_pipeline.constants import SetBy
from verl_pipeline.exceptions import ConfigError
from verl_pipeline.rundir import RunDir
from verl_pipeline.spec import RunSpec

STEPS_KEY = "trainer.total_training_steps"
EPOCHS_KEY = "trainer.total_epochs"

_WHO = {SetBy.DEFAULT: "the default", SetBy.PROFILE: "a profile", SetBy.ASKED: "asked for this run"}


@dataclass(frozen=True)
class RunLength:
    """The run's steps and epochs, and why (the same words for both keys)."""

    steps: int
    epochs: int
    rule: str
    #: Set when the steps and epochs asked disagree with the data (the rule says how): worth a warning.
    disagrees: bool = False


def steps_per_epoch(train_rows: int, settings: dict[str, Any]) -> tuple[int, int]:
    """verl's steps per epoch for ``train_rows`` rows, and the rows it reads (``data.train_max_samples`` caps them).

    verl 0.9.1's v1 trainer divides by ``data.train_batch_size``; the legacy trainer (``trainer.use_v1=false``)
    counts its dataloader's batches, of ``data.gen_batch_size`` when set."""
    cap = int(settings.get("data.train_max_samples", -1) or -1)
    rows = min(train_rows, cap) if cap > 0 else train_rows
    batch = int(settings.get("data.train_batch_size") or 1)
    if settings.get("trainer.use_v1") is False:
        batch = int(settings.get("data.gen_batch_size") or batch)
    return rows // batch, rows


def run_length(*, steps: int, steps_set_by: SetBy, epochs: int | None, epochs_set_by: SetBy | None,
               train_rows: int | None, settings: dict[str, Any]) -> RunLength:
    """The rule (module docstring): ``steps`` and ``epochs`` as the spec has them, who set each, the training
    rows (None before the data is prepared) and the run's verl settings (batch sizes)."""
    batch = int(settings.get("data.train_batch_size") or 1)
    epochs_win = epochs is not None and epochs_set_by is not None and epochs_set_by.rank > steps_set_by.rank
    given_steps = f"total_training_steps={steps} ({_WHO[steps_set_by]})"
    given_epochs = f"{EPOCHS_KEY}={epochs} ({_WHO[epochs_set_by]})" if epochs is not None and epochs_set_by else None
    if train_rows is None:
        if epochs_win:
            return RunLength(steps, int(epochs or 1), f"{given_epochs} wins over {given_steps}: the steps are "
                             f"{epochs} epoch(s) x the training rows' batches, counted when the data is prepared")
        return RunLength(steps, max(epochs or 0, steps), f"{given_steps}{_over(given_epochs)}; epochs >= the steps, "
                         "so verl's epoch count never ends the run first (the training rows are not counted yet)")
    per_epoch, rows = steps_per_epoch(train_rows, settings)
    data = f"{rows} training rows // data.train_batch_size {batch} = {per_epoch} step(s) per epoch (verl drops " \
           "the last incomplete batch)"
    if per_epoch < 1:
        raise ConfigError("data.train_batch_size", batch,
                          f"the data has {rows} training row(s), fewer than one batch: verl drops an incomplete "
                          "batch, so an epoch would have no step",
                          f"data.train_batch_size <= {rows} (with the batch rules' multiple), or more training rows")
    if epochs_win:
        total = int(epochs or 1) * per_epoch
        lost = steps_set_by is not SetBy.DEFAULT and total != steps
        return RunLength(total, int(epochs or 1),
                         f"{given_epochs} wins over {given_steps} (the later layer): {epochs} x {data} = {total} "
                         "step(s)" + (f"; the {steps} step(s) are not trained" if lost else ""), disagrees=lost)
    passes = steps / per_epoch
    short = epochs is not None and int(epochs) * per_epoch < steps
    rule = (f"{given_steps}{_over(given_epochs)}: {passes:.3g} pass(es) over the data ({data}); epochs >= the steps, "
            "so verl's epoch count never ends the run first")
    if short:
        rule += f" ({epochs} epoch(s) would have ended it after {int(epochs or 0) * per_epoch} step(s))"
    return RunLength(steps, max(epochs or 0, steps), rule, disagrees=short or passes > 1)


def _over(given_epochs: str | None) -> str:
    return f" wins over {given_epochs} (steps win in the same or a later layer, as in verl)" if given_epochs else ""


def length_of(spec: RunSpec, settings: dict[str, Any], train_rows: int | None) -> RunLength:
    """:func:`run_length` for a run: its spec's steps and ``trainer.total_epochs``, and who set each."""
    epochs = settings.get(EPOCHS_KEY)
    return run_length(steps=spec.total_training_steps, steps_set_by=spec.steps_set_by,
                      epochs=int(epochs) if epochs is not None else None,
                      epochs_set_by=spec.epochs_set_by if epochs is not None else None,
                      train_rows=train_rows, settings=settings)


def planned_steps(spec: RunSpec) -> int:
    """The steps the run trains: its rendered job's (``job.json``), else the spec's (no job rendered yet)."""
    job = RunDir(spec.run_dir).job() or {}
    return int((job.get("settings") or {}).get(STEPS_KEY) or spec.total_training_steps)


__all__ = ["EPOCHS_KEY", "STEPS_KEY", "RunLength", "length_of", "planned_steps", "run_length", "steps_per_epoch"]
