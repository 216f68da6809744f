"""The pipeline's Airflow Assets, defined in ONE place (producers' outlets and consumers' schedules).

The preprocessed-data Asset of a profile is updated by whatever DAG (re)builds that profile's
training data; retraining DAGs are scheduled on it (data-aware scheduling). The trained-model Asset
of a profile is updated by the export task after a training run's model was merged and verified; a
serving DAG can be scheduled on it.
"""

from __future__ import annotations

from typing import Any

from verl_pipeline.paths import slug

#: URI scheme of the pipeline's assets (a logical identity, not a storage location: the data itself is
#: content-keyed under the pipeline home, at a path that changes with its content).
ASSET_SCHEME = "verl-pipeline"


#: The Airflow asset group of every pipeline asset.
ASSET_GROUP = "verl-pipeline"


def _uri(kind: str, profile: str) -> str:
    return f"{ASSET_SCHEME}://{kind}/{slug(profile, 80)}"


def _asset(name_prefix: str, uri: str, profile: str) -> Any:
    from airflow.sdk import Asset

    return Asset(name=f"{name_prefix}__{slug(profile, 80).replace('-', '_')}", uri=uri, group=ASSET_GROUP)


def _alias(name: str) -> Any:
    from airflow.sdk import AssetAlias

    return AssetAlias(name=name, group=ASSET_GROUP)


def preprocessed_data_uri(profile: str) -> str:
    """``verl-pipeline://preprocessed-data/<profile>``: the URI of a profile's preprocessed data."""
    return _uri("preprocessed-data", profile)


#: The AssetAlias a producing task declares as its outlet: the profile (and so the Asset) is only
#: known at run time, from the DAG run's params.
PREPROCESSED_DATA_ALIAS = "verl_pipeline_preprocessed_data"


def preprocessed_data_alias() -> Any:
    return _alias(PREPROCESSED_DATA_ALIAS)


def preprocessed_data_asset(profile: str) -> Any:
    """The :class:`airflow.sdk.Asset` for a profile's preprocessed (verl parquet) data."""
    return _asset("verl_preprocessed_data", preprocessed_data_uri(profile), profile)


def trained_model_uri(profile: str) -> str:
    """``verl-pipeline://models/<profile>``: the URI of a profile's newest exported, verified model."""
    return _uri("models", profile)


#: The AssetAlias the export task declares as its outlet (the profile is known only at run time).
TRAINED_MODEL_ALIAS = "verl_pipeline_trained_model"


def trained_model_alias() -> Any:
    return _alias(TRAINED_MODEL_ALIAS)


def model_event_extra(exported: dict[str, Any]) -> dict[str, Any]:
    """What a trained-model Asset event carries of the export's manifest (``model.json``)."""
    return {k: exported.get(k) for k in ("model_dir", "step", "run_key", "final_reward", "data_hash")}


def trained_model_asset(profile: str) -> Any:
    """The :class:`airflow.sdk.Asset` a serving DAG is scheduled on: a new model of ``profile`` (HF safetensors)."""
    return _asset("verl_trained_model", trained_model_uri(profile), profile)
