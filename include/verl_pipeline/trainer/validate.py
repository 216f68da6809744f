"""Compose verl's own Hydra config from the installed verl package and run verl's own checks."""

from __future__ import annotations

import contextlib
import io
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl_pipeline.exceptions import PipelineError

log = logging.getLogger(__name__)


class VerlConfigError(PipelineError):
    """verl rejected the configuration (composition or validation)."""


@dataclass(frozen=True)
class Validated:
    config: Any  # omegaconf.DictConfig
    use_critic: bool
    use_reference_policy: bool
    n_gpus: int
    seconds: float


def verl_config_dir() -> Path:
    import verl

    return Path(verl.__file__).parent / "trainer" / "config"


def compose(overrides: Sequence[str], config_name: str = "ppo_trainer") -> Any:
    """verl's ``ppo_trainer.yaml`` with ``overrides`` applied, exactly as ``main_ppo`` composes it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=str(verl_config_dir()), version_base=None):
            return hydra_compose(config_name=config_name, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as e:
        raise VerlConfigError(f"verl could not compose the configuration: {e}") from None


def validate(overrides: Sequence[str]) -> Validated:
    """Compose and run verl's ``validate_config`` (which runs the actor/critic dataclass checks).

    Validates for the shape in the overrides (``trainer.nnodes`` x ``trainer.n_gpus_per_node``),
    not for the machine this runs on.
    """
    t0 = time.monotonic()
    cfg = compose(overrides)
    from omegaconf.errors import OmegaConfBaseException
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    try:
        use_critic = bool(need_critic(cfg))
        use_ref = bool(need_reference_policy(cfg))
        # verl prints progress; keep it out of our stdout (the job log) unless it fails.
        with contextlib.redirect_stdout(io.StringIO()):
            validate_config(cfg, use_reference_policy=use_ref, use_critic=use_critic)
    except (AssertionError, ValueError, TypeError, KeyError, OmegaConfBaseException) as e:
        raise VerlConfigError(f"verl rejected the configuration: {e}") from None
    n_gpus = int(cfg.trainer.nnodes) * int(cfg.trainer.n_gpus_per_node)
    return Validated(cfg, use_critic, use_ref, n_gpus, round(time.monotonic() - t0, 2))
