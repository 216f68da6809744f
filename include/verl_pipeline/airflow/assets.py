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


def preprocessed_data_uri(profile: str) -> str:
    """``verl-pipeline://preprocessed-data/<profile>``: the URI of a profile's preprocessed data."""
    return f"{ASSET_SCHEME}://preprocessed-data/{slug(profile, 80)}"


#: The AssetAlias a producing task declares as its outlet: the profile (and so the Asset) is only
#: known at run time, from the DAG run's params.
PREPROCESSED_DATA_ALIAS = "verl_pipeline_preprocessed_data"


def preprocessed_data_alias() -> Any:
    from airflow.sdk import AssetAlias

    return AssetAlias(name=PREPROCESSED_DATA_ALIAS, group="verl-pipeline")


def preprocessed_data_asset(profile: str) -> Any:
    """The :class:`airflow.sdk.Asset` for a profile's preprocessed (verl parquet) data."""
    from airflow.sdk import Asset

    return Asset(name=f"verl_preprocessed_data__{slug(profile, 80).replace('-', '_')}",
                 uri=preprocessed_data_uri(profile), group="verl-pipeline")


def trained_model_uri(profile: str) -> str:
    """``verl-pipeline://models/<profile>``: the URI of a profile's newest exported, verified model."""
    return f"{ASSET_SCHEME}://models/{slug(profile, 80)}"


#: The AssetAlias the export task declares as its outlet (the profile is known only at run time).
TRAINED_MODEL_ALIAS = "verl_pipeline_trained_model"


def trained_model_alias() -> Any:
    from airflow.sdk import AssetAlias

    return AssetAlias(name=TRAINED_MODEL_ALIAS, group="verl-pipeline")


def trained_model_asset(profile: str) -> Any:
    """The :class:`airflow.sdk.Asset` a serving DAG is scheduled on: a new model of ``profile`` (HF safetensors)."""
    from airflow.sdk import Asset

    return Asset(name=f"verl_trained_model__{slug(profile, 80).replace('-', '_')}",
                 uri=trained_model_uri(profile), group="verl-pipeline")
