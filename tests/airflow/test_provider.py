"""The provider info (``verl_pipeline.airflow.provider``): well-formed for Airflow, every class it names imports
and is what it is listed as, and Airflow's own discovery registers it from the package's entry point."""

from __future__ import annotations

import importlib
import inspect
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import tomllib

from verl_pipeline import __version__
from verl_pipeline.airflow.provider import CONNECTION_TYPE, PACKAGE_NAME, get_provider_info

REPO = Path(__file__).resolve().parents[2]
ENTRY_POINT = "verl_pipeline.airflow.provider:get_provider_info"


def _schema() -> dict:
    import airflow

    return json.loads((Path(airflow.__file__).parent / "provider_info.schema.json").read_text())


def _import(dotted: str) -> Any:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_the_info_is_valid_by_airflows_schema_and_names_this_distribution() -> None:
    from jsonschema import Draft7Validator

    info = get_provider_info()
    Draft7Validator(_schema()).validate(info)
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert info["package-name"] == PACKAGE_NAME == project["name"]
    assert info["versions"] == [__version__] == [project["version"]]
    assert project["entry-points"]["apache_airflow_provider"] == {"provider_info": ENTRY_POINT}
    # Every section's integration is one the info declares.
    names = {i["integration-name"] for i in info["integrations"]}
    assert {s["integration-name"] for k in ("operators", "hooks", "triggers") for s in info[k]} <= names


def test_every_module_and_class_it_names_imports_and_is_what_it_is_listed_as() -> None:
    from airflow.sdk import BaseOperator, BaseOperatorLink
    from airflow.sdk.bases.hook import BaseHook
    from airflow.triggers.base import BaseTrigger

    info = get_provider_info()
    kinds = {"operators": BaseOperator, "hooks": BaseHook, "triggers": BaseTrigger}
    for section, base in kinds.items():
        for module_name in (m for s in info[section] for m in s["python-modules"]):
            module = importlib.import_module(module_name)
            defined = [c for _, c in inspect.getmembers(module, inspect.isclass)
                       if issubclass(c, base) and c.__module__ == module_name]
            assert defined, f"{section}: {module_name} defines no {base.__name__}"
    for link in info["extra-links"]:
        assert issubclass(_import(link), BaseOperatorLink), link
    [conn] = info["connection-types"]
    hook = _import(conn["hook-class-name"])
    assert hook.conn_type == conn["connection-type"] == CONNECTION_TYPE
    assert hook.hook_name == conn["hook-name"]
    # The form's own fields are the extras the hook reads.
    assert set(conn["conn-fields"]) == {"dashboard_url", "ca_bundle"}


def test_reading_the_info_imports_neither_airflow_nor_ray() -> None:
    import subprocess

    code = ("import sys; from verl_pipeline.airflow.provider import get_provider_info; get_provider_info(); "
            "print(sorted(m for m in ('airflow', 'ray', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(REPO / "include")})
    assert out.stdout.strip() == "[]"


def test_airflows_discovery_registers_the_provider_from_the_entry_point(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``pip install`` leaves (a dist-info with the entry point), read by Airflow's own discovery."""
    from airflow._shared import module_loading
    from airflow._shared.providers_discovery import discover_all_providers_from_packages
    from airflow.providers_manager import _create_provider_info_schema_validator

    dist = tmp_path / f"verl_pipeline-{__version__}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PACKAGE_NAME}\nVersion: {__version__}\n")
    (dist / "entry_points.txt").write_text(f"[apache_airflow_provider]\nprovider_info = {ENTRY_POINT}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module_loading._get_grouped_entry_points.cache_clear()
    try:
        found: dict = {}
        discover_all_providers_from_packages(found, _create_provider_info_schema_validator())
    finally:
        module_loading._get_grouped_entry_points.cache_clear()
    assert found[PACKAGE_NAME].version == __version__
    assert found[PACKAGE_NAME].data["connection-types"][0]["connection-type"] == CONNECTION_TYPE
