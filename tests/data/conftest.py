from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import GSM8K_DIR


@pytest.fixture
def gsm8k_dir() -> Path:
    """The real GSM8K beside the repo (../shared), or where VERL_PIPELINE_GSM8K_DIR points (a worktree
    checked out elsewhere); skip when absent."""
    for d in (GSM8K_DIR, Path(os.environ.get("VERL_PIPELINE_GSM8K_DIR", "/nonexistent"))):
        if (d / "train.jsonl").is_file():
            return d
    pytest.skip(f"GSM8K not found at {GSM8K_DIR} (or $VERL_PIPELINE_GSM8K_DIR)")
