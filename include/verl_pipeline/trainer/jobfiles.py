"""The user's own files a verl job reads on the cluster's nodes: shipped with the job, or checked there.

verl names a task's files in its configuration: the reward function, a reward manager module, a tool
config and a function-tool module, an agent-loop config, a custom async server, a dataset class. Each is
opened by a process on some node (the reward loop's workers, the agent loop's, the driver), in that
process's working directory when the path is relative. So each file named in a run is, before the job
is submitted:

- **on shared storage** (under the cluster profile's ``storage.shared``): left as it is, and the
  environment probe checks it exists on every node (:data:`verl_pipeline.trainer.environment.PATH_KEYS`);
- **anywhere else** (the Airflow side's disk, the configs directory): copied into the run's
  ``job_files/`` folder, which the job's ``runtime_env`` ``working_dir`` ships to every node (Ray
  starts each worker in its node's copy, on ``sys.path``), and the key rewritten to the file's name in it.

A LoRA adapter (``lora_adapter_path``, a directory of weights) is not shipped: it must be on shared
storage on a cluster of its own nodes (a local head shares this disk). The run profile's ``job_files:``
lists more files to ship beside them: a tool's Python module a tool config names by ``class_name``.

Relative paths are relative to the configs directory (as a recipe's ``custom_reward_path`` is). A file
that does not exist is refused in one line when the run is built, before any cluster starts.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl_pipeline.exceptions import ConfigError

#: verl 0.9.1's settings that name a file a job process opens (verl/trainer/config/ppo_trainer.yaml).
FILE_KEYS = (
    "reward.custom_reward_function.path",
    "custom_reward_function.path",
    "reward.reward_manager.module.path",
    "reward_model.reward_loop_module_path",
    "actor_rollout_ref.rollout.multi_turn.tool_config_path",
    "actor_rollout_ref.rollout.multi_turn.function_tool_path",
    "data.tool_config_path",
    "actor_rollout_ref.rollout.agent.agent_loop_config_path",
    "actor_rollout_ref.rollout.agent.custom_async_server.path",
    "data.custom_cls.path",
)
#: Settings naming a directory of weights: never shipped, checked on every node.
DIR_KEYS = ("actor_rollout_ref.model.lora_adapter_path", "critic.model.lora_adapter_path")
#: The run profile's key listing more files to ship with the job.
EXTRA_KEY = "job_files"


@dataclass(frozen=True)
class Shipped:
    """One file copied into the job's working_dir: the setting that names it ("" for a ``job_files``
    entry), where it is on this side, and its name in the working_dir."""

    key: str
    source: str
    name: str


@dataclass(frozen=True)
class JobFiles:
    """The run's own files: those shipped with the job and the ``(setting, path)`` pairs checked on the nodes."""

    shipped: tuple[Shipped, ...] = ()
    checked: tuple[tuple[str, str], ...] = ()

    def settings(self) -> dict[str, str]:
        """The settings that name a shipped file, as the job reads them: its name in the working_dir."""
        return {s.key: s.name for s in self.shipped if s.key}

    def notes(self) -> list[str]:
        """What ``render`` says of the shipped ones (its ``# needs:`` lines name the checked ones with the
        other paths every node must see)."""
        return [f"ships {s.source} with the job (runtime_env working_dir, as {s.name})"
                + (f" for {s.key}" if s.key else f" ({EXTRA_KEY})") for s in self.shipped]


def _text(value: Any, key: str) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ConfigError(key, value, "must be a path", f"{key}=my_task/tools.yaml (relative to the configs dir)")
    return value.strip().removeprefix("file://")


def absolute(settings: Mapping[str, Any], extra: Iterable[Any], *,
             base: Path) -> tuple[dict[str, str], tuple[str, ...]]:
    """Every file setting and ``job_files`` entry made absolute (relative to ``base``, the configs
    directory) and checked to exist on this side: ``(settings to update, job_files)``."""
    updates: dict[str, str] = {}
    for key in (*FILE_KEYS, *DIR_KEYS):
        text = _text(settings.get(key), key)
        if text is None:
            continue
        path = Path(text).expanduser()
        path = path if path.is_absolute() else (base / path).resolve()
        want_dir = key in DIR_KEYS
        if not (path.is_dir() if want_dir else path.is_file()):
            raise ConfigError(key, text, f"no such {'directory' if want_dir else 'file'} ({path})",
                              f"the path of the {'adapter directory' if want_dir else 'file'}: absolute, or "
                              f"relative to the configs directory {base}")
        if str(path) != text:
            updates[key] = str(path)
    files: list[str] = []
    for i, entry in enumerate(extra):
        text = _text(entry, f"{EXTRA_KEY}[{i}]")
        path = Path(text or "").expanduser()
        path = path if path.is_absolute() else (base / path).resolve()
        if not text or not path.is_file():
            raise ConfigError(f"{EXTRA_KEY}[{i}]", entry, f"no such file ({path})",
                              f"a file to ship with the job: absolute, or relative to the configs directory {base}")
        files.append(str(path))
    return updates, tuple(files)


def plan(settings: Mapping[str, Any], extra: Iterable[str], *, shared_roots: tuple[str, ...],
         local: bool) -> JobFiles:
    """Which of the run's files ship with the job and which are checked on the nodes (a pure function of
    absolute paths). ``local``: the cluster is this machine's own Ray head, which sees every path here."""
    from verl_pipeline.spec import require_shared, under_shared

    shipped: list[Shipped] = []
    checked: list[tuple[str, str]] = []
    names: dict[str, str] = {}

    def ship(key: str, source: str) -> None:
        name = Path(source).name
        if names.setdefault(name, source) != source:
            raise ConfigError(key or EXTRA_KEY, source, f"has the name of another file shipped with the job "
                              f"({names[name]}): both would be {name} in its working_dir",
                              "rename one of them, or put one on shared storage")
        shipped.append(Shipped(key, source, name))

    for key in FILE_KEYS:
        path = settings.get(key)
        if not isinstance(path, str) or not path.startswith("/"):
            continue
        if under_shared(path, shared_roots):
            checked.append((key, path))
        else:
            ship(key, path)
    for key in DIR_KEYS:
        path = settings.get(key)
        if not isinstance(path, str) or not path:
            continue
        if not local:
            require_shared(key, path, shared_roots,
                           "the nodes would not find the adapter (a directory of weights is not shipped with the job)")
        checked.append((key, path))
    for source in extra:
        ship("", source)
    return JobFiles(tuple(shipped), tuple(checked))


def stage(files: JobFiles, dest: Path) -> Path:
    """Copy the shipped files into ``dest`` (the run's ``job_files/``), replacing what an earlier attempt
    left there, so the working_dir holds exactly this job's files. Returns ``dest``."""
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for s in files.shipped:
        shutil.copy2(s.source, tmp / s.name)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


__all__ = ["DIR_KEYS", "EXTRA_KEY", "FILE_KEYS", "JobFiles", "Shipped", "absolute", "plan", "stage"]
