"""Plan the run's models and prefetch each into the shared cache."""

from __future__ import annotations

from typing import Any

from airflow.sdk.exceptions import AirflowFailException

from verl_pipeline.airflow.operators.base import HF_CONN_ID, PipelineOperator, connection, spec_from_context, task_error
from verl_pipeline.exceptions import PipelineError


class PlanModelsOperator(PipelineOperator):
    """List the run's distinct models with the roles each plays: what ``prefetch_model`` maps over.

    Returns ``[{"source": ..., "roles": ["actor", ...]}, ...]`` (the actor's model first).
    """

    ui_color = "#fdebd0"

    def execute(self, context: Any) -> list[dict[str, Any]]:
        from verl_pipeline.models.prefetch import plan_models

        try:
            plan = plan_models(spec_from_context(context))
        except PipelineError as e:
            raise task_error(e) from e
        for item in plan:
            self.log.info("Model %s for %s", item["source"], ", ".join(item["roles"]))
        return plan


class PrefetchModelOperator(PipelineOperator):
    """Fetch (or build) one model of the run into the shared cache, verify it, return its local path by role.

    ``model`` is one item of :class:`PlanModelsOperator`'s result (the DAG maps this operator over
    them); without it, every model of the run is fetched in turn. The hub token comes from the
    Airflow connection ``hf_conn_id`` (password) when it exists, else from ``HF_TOKEN``; it is never
    logged. Returns ``{role: {"path": ..., "commit": ..., ...}}``.
    """

    ui_color = "#fdebd0"

    def __init__(self, *, model: dict[str, Any] | None = None, hf_conn_id: str | None = HF_CONN_ID,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.model = model
        self.hf_conn_id = hf_conn_id

    def _hub_token(self) -> str | None:
        if not self.hf_conn_id:
            return None
        from airflow.sdk.exceptions import AirflowNotFoundException

        try:
            conn = connection(self.hf_conn_id)
        except AirflowNotFoundException:  # normal: public models need no token
            self.log.info("No Airflow connection %r: hub requests use HF_TOKEN if set", self.hf_conn_id)
            return None
        if conn.password:
            from airflow.sdk.log import mask_secret

            mask_secret(conn.password)  # redacted should any library ever print it
        return conn.password or None

    def execute(self, context: Any) -> dict[str, Any]:
        from verl_pipeline.models.hub import ModelAccessError
        from verl_pipeline.models.prefetch import prefetch_roles, prefetch_run

        token = self._hub_token()
        try:
            spec = spec_from_context(context)
            if self.model:
                roles = list(self.model.get("roles") or [])
                context["model_label"] = f"{'+'.join(roles)}: {self.model.get('source')}"
                out = prefetch_roles(spec, roles, token=token)
                source = out[roles[0]]["source"]
                if self.model.get("source") and source != self.model["source"]:
                    raise AirflowFailException(f"model of {roles} changed since planning: {self.model['source']} "
                                               f"-> {source}")
            else:
                out = prefetch_run(spec, token=token)
        except ModelAccessError as e:  # gated, unknown repo or revision: a retry cannot succeed
            raise AirflowFailException(f"{type(e).__name__}: {e}") from e
        except PipelineError as e:
            raise task_error(e) from e
        for role, r in out.items():
            self.log.info("%s: %s (%s)", role, r["path"], "cache hit" if r.get("cached") else "fetched")
        return out
