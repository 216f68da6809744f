"""The trigger form's Params as Airflow 3.3's form reads them: labels, optional fields, validation."""

from __future__ import annotations

import pytest

from verl_pipeline.airflow.params import build_params


def _schemas() -> dict[str, dict]:
    return {name: param.schema for name, param in build_params().items()}


def test_every_enum_choice_has_a_label_and_none_is_never_shown_as_null() -> None:
    # The form labels a choice with values_display[str(value)], else values_display["None"], else the raw
    # value ("null" for None): every choice needs its own label or it borrows the empty choice's.
    for name, schema in _schemas().items():
        if None not in schema.get("enum", []):
            continue
        labels = schema["values_display"]
        assert set(labels) == set(schema["enum"]), name
        assert labels[None] and "null" not in labels[None].lower(), name
        assert all(labels[v] == v for v in schema["enum"] if v is not None), name


def test_only_the_profile_is_required_in_the_form() -> None:
    # The form marks a field required when its schema has a type without "null".
    required = [name for name, s in _schemas().items() if "null" not in (s["type"] if isinstance(s["type"], list)
                                                                         else [s["type"]])]
    assert required == ["profile"]


def test_every_field_shows_an_example() -> None:
    for name, param in build_params().items():
        text = param.description or ""
        assert "e.g." in text or "builtin:" in text or "auto:" in text or "colocated:" in text, name


def test_airflow_validates_the_form_values() -> None:
    # What the REST API and `airflow dags test` run on a trigger's conf; the form sends null for a
    # cleared field.
    from airflow.sdk.definitions.param import ParamsDict
    from airflow.sdk.exceptions import ParamValidationError

    ok = ParamsDict(build_params())
    ok.update({"verl_overrides": None, "model_profile": None, "mode": "preflight"})
    ok.validate()
    ok.update({"verl_overrides": ["trainer.save_freq=1", "+a.b=sdpa"]})
    ok.validate()
    ok.update({"verl_overrides": ["trainer.save_freq=1", ""]})  # the form's trailing newline
    ok.validate()
    for name, bad in [("verl_overrides", "trainer.save_freq=1"), ("verl_overrides", ["no equals"]),
                      ("mode", "fast"), ("model_profile", "no-such-model")]:
        params = ParamsDict(build_params())
        with pytest.raises(ParamValidationError, match=f"^Invalid input for param {name}: "):
            params.update({name: bad})
