"""Preprocess the run's data into verl's parquet (and publish it as an Asset)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from verl_pipeline.airflow.operators.base import PipelineOperator, spec_from_context, task_error
from verl_pipeline.exceptions import PipelineError


#: The preprocessed train/val parquet: a retraining DAG can be scheduled on it (``schedule=[...]``).
#: Each event's ``extra`` names the files, the content key and whether they are new.
class PreprocessDataOperator(PipelineOperator):
    """Write the run's train/val parquet in verl's row schema (checked, content-keyed, atomic).

    ``recipe`` (templated) replaces the profile's recipe; the DAG passes its ``recipe`` param.
    With ``emit_asset`` the output is an event on the run profile's preprocessed-data Asset
    (through the :func:`preprocessed_data_alias` outlet), which retraining DAGs are scheduled on;
    a DAG scheduled on that Asset must not emit it (it would trigger itself).
    """

    template_fields: Sequence[str] = ("recipe",)

    def __init__(self, *, recipe: str | None = None, emit_asset: bool = True, **kwargs: Any) -> None:
        if emit_asset:
            from verl_pipeline.airflow.assets import preprocessed_data_alias

            kwargs.setdefault("outlets", [preprocessed_data_alias()])
        super().__init__(**kwargs)
        self.recipe = recipe
        self.emit_asset = emit_asset

    def execute(self, context: Any) -> dict[str, Any]:
        from verl_pipeline import steps

        try:
            spec = spec_from_context(context)
            result = steps.preprocess(spec, recipe=self.recipe or None)
        except PipelineError as e:
            raise task_error(e) from e
        c = result.counts
        self.log.info("Data (%s): %d rows in, %d train / %d val written, rejected %s, %d duplicates, %d too long%s",
                      c.get("recipe"), c.get("records_in", 0), c.get("train_rows", 0), c.get("val_rows", 0),
                      c.get("rejected"), c.get("deduplicated", 0), c.get("too_long", 0),
                      " (cached)" if result.cached else "")
        events = context.get("outlet_events")
        if self.emit_asset and events is not None:
            from verl_pipeline.airflow.assets import preprocessed_data_alias, preprocessed_data_asset

            events[preprocessed_data_alias()].add(
                preprocessed_data_asset(spec.profile),
                extra={"train_path": result.train_path, "val_path": result.val_path, "key": result.key,
                       "cached": result.cached, "recipe": c.get("recipe"), "rows": c.get("written")},
            )
        return result.to_dict()
