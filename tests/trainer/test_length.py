"""The run's length: steps or epochs, whichever the later layer set, counted against the training rows."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from verl_pipeline.constants import Mode, SetBy
from verl_pipeline.exceptions import ConfigError
from verl_pipeline.profiles import build_run_spec
from verl_pipeline.rundir import RunDir
from verl_pipeline.trainer.length import planned_steps, run_length, steps_per_epoch
from verl_pipeline.trainer.render import render_job

BATCH = {"data.train_batch_size": 16}


def _length(steps: int, steps_by: SetBy, epochs: int | None, epochs_by: SetBy | None, rows: int | None,
            **settings: Any) -> Any:
    return run_length(steps=steps, steps_set_by=steps_by, epochs=epochs, epochs_set_by=epochs_by, train_rows=rows,
                      settings={**BATCH, **settings})


def test_epochs_asked_win_over_a_profiles_steps() -> None:
    # 70 rows in batches of 16: 4 steps an epoch, the last 6 rows dropped as verl drops them.
    length = _length(2, SetBy.PROFILE, 3, SetBy.ASKED, 70)
    assert (length.steps, length.epochs) == (12, 3)
    assert length.rule.startswith("trainer.total_epochs=3 (asked for this run) wins over total_training_steps=2 "
                                  "(a profile)")
    assert "3 x 70 training rows // data.train_batch_size 16 = 4 step(s) per epoch" in length.rule
    assert "the 2 step(s) are not trained" in length.rule and length.disagrees
    # Over the pipeline's default of one step: nothing asked is lost, nothing to warn of.
    quiet = _length(1, SetBy.DEFAULT, 3, SetBy.PROFILE, 70)
    assert (quiet.steps, quiet.epochs, quiet.disagrees) == (12, 3, False)


def test_steps_win_in_the_same_or_a_later_layer_and_the_epochs_cover_them() -> None:
    # Both asked: the steps win, as in verl; the 2 epochs asked would have ended the run after 8 steps.
    length = _length(10, SetBy.ASKED, 2, SetBy.ASKED, 64)
    assert (length.steps, length.epochs) == (10, 10) and length.disagrees
    assert "wins over trainer.total_epochs=2 (asked for this run)" in length.rule
    assert "2 epoch(s) would have ended it after 8 step(s)" in length.rule
    # A profile's epochs under asked steps: the steps win too.
    assert _length(10, SetBy.ASKED, 2, SetBy.PROFILE, 64).steps == 10
    # Epochs that already cover the steps are kept.
    assert _length(3, SetBy.ASKED, 5, SetBy.PROFILE, 64).epochs == 5


def test_many_steps_on_few_rows_say_how_many_passes_they_are() -> None:
    length = _length(500, SetBy.ASKED, None, None, 64)
    # verl's default of 30 epochs would have stopped at 120 steps, without the last step's save.
    assert (length.steps, length.epochs) == (500, 500) and length.disagrees
    assert "125 pass(es) over the data (64 training rows // data.train_batch_size 16 = 4 step(s) per epoch" \
        in length.rule
    one_pass = _length(4, SetBy.PROFILE, None, None, 64)
    assert (one_pass.steps, one_pass.epochs, one_pass.disagrees) == (4, 4, False)


def test_fewer_rows_than_a_batch_is_refused() -> None:
    with pytest.raises(ConfigError) as e:
        _length(2, SetBy.PROFILE, None, None, 15)
    assert (e.value.key, e.value.value) == ("data.train_batch_size", 16)
    assert "15 training row(s), fewer than one batch" in e.value.rule and "data.train_batch_size <= 15" in str(e.value)


def test_before_the_rows_are_counted() -> None:
    steps_win = _length(7, SetBy.PROFILE, None, None, None)
    assert (steps_win.steps, steps_win.epochs) == (7, 7) and "not counted yet" in steps_win.rule
    epochs_win = _length(7, SetBy.PROFILE, 2, SetBy.ASKED, None)
    assert (epochs_win.steps, epochs_win.epochs) == (7, 2) and "counted when the data is prepared" in epochs_win.rule


def test_steps_per_epoch_follows_verls_caps_and_batch() -> None:
    assert steps_per_epoch(100, BATCH) == (6, 100)
    assert steps_per_epoch(100, {**BATCH, "data.train_max_samples": 40}) == (2, 40)
    # The legacy trainer counts its dataloader's batches, of gen_batch_size when set.
    assert steps_per_epoch(100, {**BATCH, "trainer.use_v1": False, "data.gen_batch_size": 50}) == (2, 100)


def test_a_run_renders_the_epochs_asked_and_says_why(tmp_path: Path) -> None:
    spec = build_run_spec({}, run_name="length/epochs", overrides={"trainer.total_epochs": 3})  # smoke: 2 steps
    assert (spec.steps_set_by, spec.epochs_set_by) == (SetBy.PROFILE, SetBy.ASKED)
    batch = int(spec.verl["data.train_batch_size"])
    job = render_job(spec, mode=Mode.TRAIN, train_files="/d/t", val_files="/d/v", model_path="/m",
                     train_rows=5 * batch + 1)
    assert (job.settings["trainer.total_training_steps"], job.settings["trainer.total_epochs"]) == (15, 3)
    assert job.settings["trainer.save_freq"] == 15  # unset: one save, at the (new) end
    for key in ("trainer.total_training_steps", "trainer.total_epochs"):
        assert "trainer.total_epochs=3 (asked for this run) wins over total_training_steps=2 (a profile)" \
            in job.derived[key], job.derived[key]
    # The steps param (CLI --total-training-steps) is a later layer than a profile's epochs.
    spec = build_run_spec({"total_training_steps": 6}, run_name="length/steps")
    assert spec.steps_set_by is SetBy.ASKED and spec.epochs_set_by is None
    job = render_job(spec, mode=Mode.TRAIN, train_files="/d/t", val_files="/d/v", model_path="/m",
                     train_rows=2 * batch)
    assert (job.settings["trainer.total_training_steps"], job.settings["trainer.total_epochs"]) == (6, 6)
    # What the wait and the report count against: the rendered job's steps once it is saved, else the spec's.
    spec = replace(build_run_spec({}, run_name="length/saved", overrides={"trainer.total_epochs": 3}),
                   storage_root=tmp_path)
    assert planned_steps(spec) == spec.total_training_steps == 2
    RunDir(spec.run_dir).save_job(render_job(spec, mode=Mode.TRAIN, train_files="/d/t", val_files="/d/v",
                                             model_path="/m", train_rows=5 * batch).to_dict())
    assert planned_steps(spec) == 15


@pytest.mark.parametrize("value", [0, -1])
def test_epochs_that_train_nothing_are_refused(value: int) -> None:
    with pytest.raises(ConfigError) as e:
        build_run_spec({}, run_name="length/bad", overrides={"trainer.total_epochs": value})
    assert (e.value.key, e.value.value) == ("trainer.total_epochs", value)
    assert "positive number of epochs" in e.value.rule
