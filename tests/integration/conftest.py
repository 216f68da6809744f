"""Fixtures shared by the integration tests: one real Airflow stack (PostgreSQL + four components)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest

from tests.integration.airflow_stack import AirflowStack, StackUnavailable


@pytest.fixture(scope="session")
def airflow_stack() -> Iterator[AirflowStack]:
    """Started once for the scheduler and the UI tests; every process it started is stopped after."""
    stack = AirflowStack()
    try:
        stack.start()
    except StackUnavailable as e:
        stack.stop()
        if os.environ.get("CI"):
            pytest.fail(f"CI: {e}")
        pytest.skip(str(e))
    except BaseException:
        stack.stop()
        raise
    yield stack
    survivors = stack.stop()
    assert survivors == [], f"processes survived the stack's shutdown: {survivors}"
    # Logs, DB and run directories are kept only when asked for (VP_KEEP_STACK=1), for debugging.
    if not os.environ.get("VP_KEEP_STACK"):
        shutil.rmtree(stack.root, ignore_errors=True)


@pytest.fixture(scope="session")
def canaries(airflow_stack: AirflowStack) -> dict[str, str]:
    """A unique fake value for every secret the pipeline reads from Airflow connections (hub token,
    Ray token, cluster credentials), planted in the stack before any run; see secret_canary."""
    from tests.integration import secret_canary

    values = secret_canary.new_canaries()
    with airflow_stack.client() as api:
        secret_canary.plant_connections(api, values)
    return values
