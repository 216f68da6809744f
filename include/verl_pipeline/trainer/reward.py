"""The run's reward function: where the user names it, loading it, and calling it as verl will.

verl 0.9.x ships no per-dataset rewards for new tasks: a task brings ``compute_score`` in a file and
names it with verl's ``reward.custom_reward_function.{path,name,reward_kwargs}`` (or the older top-level
``custom_reward_function.*``). A data recipe may name it too (``custom_reward_path`` /
``custom_reward_name``). :func:`resolve` reads every spelling once, refuses two that disagree, and gives
the one :class:`RewardFunction` that preprocessing checks rows with, the preflight scores with and the
job is rendered with.

verl's reward managers call it with keywords, ``compute_score(data_source=..., solution_str=...,
ground_truth=..., extra_info=..., **reward_kwargs)``, and read a number or a dict with ``score``
(verl/experimental/reward_loop/reward_manager/naive.py). :func:`call` does the same and turns each way
it can go wrong into one line naming the file, the function, the row and the fix.
"""

from __future__ import annotations

import importlib.util
import inspect
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verl_pipeline.exceptions import ConfigError, DataError

#: verl's keys for the custom reward function, and the older top-level spelling verl still reads.
PATH_KEY = "reward.custom_reward_function.path"
NAME_KEY = "reward.custom_reward_function.name"
KWARGS_KEY = "reward.custom_reward_function.reward_kwargs"
LEGACY_PATH_KEY = "custom_reward_function.path"
LEGACY_NAME_KEY = "custom_reward_function.name"
#: verl's default function name (``reward.custom_reward_function.name`` in ppo_trainer.yaml).
DEFAULT_NAME = "compute_score"
MANAGER_KEY = "reward.reward_manager.name"
MANAGER_SOURCE_KEY = "reward.reward_manager.source"
#: What verl adds to each row's ``extra_info`` before it calls the function (the naive manager).
VERL_EXTRA_INFO: dict[str, Any] = {"num_turns": None, "rollout_reward_scores": {}}
#: How a correct answer is written when the recipe does not say (a recipe's ``check_solution``).
ANSWER_FORM = "{ground_truth}"
#: A per-data_source ``check_solution``'s entry for the data_sources it does not name.
ANY_DATA_SOURCE = "*"
SIGNATURE = "compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)"


@dataclass(frozen=True)
class RewardFunction:
    """A reward function in a file: the path (absolute on the machine that resolved it), the function's
    name, the keyword arguments verl passes it, and where the user named it."""

    path: str
    name: str = DEFAULT_NAME
    kwargs: dict[str, Any] = field(default_factory=dict)
    named_by: str = PATH_KEY

    @property
    def label(self) -> str:
        return f"{self.path}:{self.name}"

    def settings(self) -> dict[str, Any]:
        """The verl settings that give the job this function (``+``: ``reward_kwargs`` is not in verl's YAML)."""
        out: dict[str, Any] = {PATH_KEY: self.path, NAME_KEY: self.name}
        if self.kwargs:
            out[f"+{KWARGS_KEY}"] = dict(self.kwargs)
        return out


def answer_forms(recipe_value: Any, option_value: Any) -> Any:
    """How a correct answer reads: the data option ``check_solution`` over the recipe's. A string replaces
    all; a mapping of data_source to form (rows in verl's schema) replaces the forms it names."""
    if option_value is None:
        return recipe_value if recipe_value is not None else ANSWER_FORM
    if isinstance(option_value, Mapping) and isinstance(recipe_value, Mapping):
        return {**recipe_value, **option_value}
    return option_value


def _lookup(settings: Mapping[str, Any], key: str) -> Any:
    from verl_pipeline.trainer.overrides import spelled

    found = spelled(settings, key)
    return None if found is None else found.value


def _absolute(text: str, base: Path, key: str) -> str:
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(key, text, "must be the path of a Python file", "reward.py (in configs/) or /abs/reward.py")
    path = Path(text.strip().removeprefix("file://")).expanduser()
    return str(path if path.is_absolute() else (base / path).resolve())


def resolve(settings: Mapping[str, Any], data_options: Mapping[str, Any], recipe_defaults: Mapping[str, Any],
            *, base: Path) -> RewardFunction | None:
    """The run's one reward function, from verl's keys in ``settings`` and the recipe's keys (the data
    options over the recipe file's ``recipe_defaults``); None when the run uses verl's built-in scorers.

    Relative paths are read from ``base`` (the configs folder). Two spellings that name different files
    or functions are refused in one line; so is ``reward_kwargs`` that is not a mapping."""
    verl_path = _lookup(settings, PATH_KEY) or _lookup(settings, LEGACY_PATH_KEY)
    verl_key = PATH_KEY if _lookup(settings, PATH_KEY) else LEGACY_PATH_KEY
    verl_name = _lookup(settings, NAME_KEY) or _lookup(settings, LEGACY_NAME_KEY)
    data_path = data_options.get("custom_reward_path") or recipe_defaults.get("custom_reward_path")
    data_name = data_options.get("custom_reward_name") or recipe_defaults.get("custom_reward_name")
    kwargs = _lookup(settings, KWARGS_KEY) or {}
    if not isinstance(kwargs, Mapping):
        raise ConfigError(KWARGS_KEY, kwargs, "must be a mapping of keyword arguments",
                          f"+{KWARGS_KEY}.scale=2 (or a reward_kwargs: section in the profile's verl:)")
    data_kwargs = data_options.get("custom_reward_kwargs") or recipe_defaults.get("custom_reward_kwargs") or {}
    if kwargs and data_kwargs and dict(kwargs) != dict(data_kwargs):
        raise ConfigError("data.custom_reward_kwargs", data_kwargs, f"differs from {KWARGS_KEY} ({dict(kwargs)})",
                          "name the keyword arguments once")
    kwargs = kwargs or data_kwargs
    if not verl_path and not data_path:
        return None
    verl_fn = data_fn = None
    if verl_path:
        verl_fn = RewardFunction(_absolute(verl_path, base, verl_key), str(verl_name or DEFAULT_NAME), dict(kwargs),
                                 verl_key)
    if data_path:
        data_fn = RewardFunction(_absolute(data_path, base, "data.custom_reward_path"),
                                 str(data_name or DEFAULT_NAME), dict(kwargs), "data.custom_reward_path")
    if verl_fn and data_fn and (verl_fn.path, verl_fn.name) != (data_fn.path, data_fn.name):
        raise ConfigError("data.custom_reward_path", data_fn.label,
                          f"names another reward function than {verl_fn.named_by} ({verl_fn.label})",
                          f"name it once: keep {verl_fn.named_by} and drop data.custom_reward_path, or the reverse")
    return verl_fn or data_fn


def apply(settings: Mapping[str, Any], fn: RewardFunction) -> dict[str, Any]:
    """``settings`` with the reward function named once, in verl's current keys: every other spelling of
    them (``+``/``++``, the top-level ``custom_reward_function``, ``reward_kwargs`` key by key) removed."""
    prefixes = ("reward.custom_reward_function", "custom_reward_function")
    out = {k: v for k, v in settings.items() if not k.lstrip("+").startswith(prefixes)}
    out.update(fn.settings())
    return out


def load(fn: RewardFunction) -> Callable[..., Any]:
    """Import the file and return the function, checking it can take verl's keyword call; one-line
    ConfigErrors for a missing file, a failing import, a missing name or a signature verl cannot call."""
    path = Path(fn.path)
    if not path.is_file():
        raise ConfigError(fn.named_by, fn.path, "no such file", "the path of your reward function's .py file")
    spec = importlib.util.spec_from_file_location(f"verl_pipeline_reward_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ConfigError(fn.named_by, fn.path, "cannot be imported as a Python module", "a .py file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise ConfigError(fn.named_by, fn.path, f"importing it failed ({type(e).__name__}: {e})",
                          "fix the file so that `python <file>` imports cleanly") from None
    func = getattr(module, fn.name, None)
    if not callable(func):
        raise ConfigError(NAME_KEY, fn.name, f"is not a function in {fn.path}",
                          f"define {SIGNATURE} there, or name the function it has")
    try:
        inspect.signature(func).bind(data_source="", solution_str="", ground_truth="", extra_info={}, **fn.kwargs)
    except TypeError as e:
        raise ConfigError(NAME_KEY, fn.label, f"verl cannot call it with its keyword arguments ({e})",
                          f"def {SIGNATURE}") from None
    except ValueError:  # a builtin without a signature: called as it is
        pass
    return func


def score_value(result: Any, fn: RewardFunction, where: str) -> float:
    """The number verl reads from what the function returned: a real number, or a dict's ``score``."""
    value = result.get("score") if isinstance(result, Mapping) else result
    if isinstance(result, Mapping) and "score" not in result:
        raise DataError(f"{where}: {fn.label} returned a dict without 'score' (keys {sorted(result)[:5]}): verl "
                        "reads the reward from result['score']. Fix: return a float, or {'score': float, ...}")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise DataError(f"{where}: {fn.label} returned {value!r} ({type(value).__name__}), not a number: verl puts "
                        "the reward in a float tensor. Fix: return a float (e.g. float(score))")
    return float(value)


def call(func: Callable[..., Any], fn: RewardFunction, *, data_source: str, solution: str, ground_truth: Any,
         extra_info: Mapping[str, Any] | None, where: str) -> float:
    """Call the function as verl's reward manager does and return the score; a raise, a non-number or a
    dict without ``score`` is one DataError naming ``where`` (file and row), the function and the fix."""
    info = {**dict(extra_info or {}), **VERL_EXTRA_INFO}
    try:
        result = func(data_source=data_source, solution_str=solution, ground_truth=ground_truth, extra_info=info,
                      **fn.kwargs)
    except Exception as e:
        raise DataError(f"{where}: {fn.label} raised {type(e).__name__}: {e} for data_source {data_source!r}, "
                        f"ground truth {ground_truth!r}, extra_info keys {sorted(info)}. Fix: the function must "
                        "score every row the data has (keep the columns it reads with data.extra_columns)") from None
    if inspect.isawaitable(result):
        import asyncio

        result = asyncio.run(_awaited(result))
    return score_value(result, fn, where)


async def _awaited(result: Any) -> Any:
    return await result


def check_manager(settings: Mapping[str, Any]) -> None:
    """``reward.reward_manager.name`` names a manager verl registers (for ``source: register``, verl's
    default). Imports verl's registry: call it where verl is installed (provision's verl check)."""
    name = _lookup(settings, MANAGER_KEY)
    source = _lookup(settings, MANAGER_SOURCE_KEY) or "register"
    if name is None or source != "register":
        return
    # Importing the registry imports its package first, which registers verl's own managers.
    from verl.experimental.reward_loop.reward_manager.registry import REWARD_MANAGER

    if name not in REWARD_MANAGER:
        raise ConfigError(MANAGER_KEY, name, "verl registers no reward manager of this name",
                          f"one of {sorted(REWARD_MANAGER)}, or reward.reward_manager.source=importlib with "
                          "reward.reward_manager.module.path naming your class's file")


__all__ = [
    "ANSWER_FORM",
    "ANY_DATA_SOURCE",
    "DEFAULT_NAME",
    "KWARGS_KEY",
    "MANAGER_KEY",
    "NAME_KEY",
    "PATH_KEY",
    "RewardFunction",
    "answer_forms",
    "apply",
    "call",
    "check_manager",
    "load",
    "resolve",
    "score_value",
]
