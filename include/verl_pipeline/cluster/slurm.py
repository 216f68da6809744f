"""A Ray cluster inside a Slurm allocation, started by an sbatch script the pipeline renders.

The script follows verl's multi-node practice: the head on the first host of
``scontrol show hostnames $SLURM_JOB_NODELIST`` (its IP resolved on that host), workers with
``srun --overlap`` on the other hosts, ``--num-cpus/--num-gpus`` from the Slurm variables. Once
every node is started it publishes the head address as a JSON file on shared storage and holds
the allocation until ``scancel``. The script is saved in the run directory and logged.

Provision = cancel a leftover allocation of the same run, ``sbatch``, wait for RUNNING, read the
published head address, then the readiness gate every backend shares. Teardown = ``scancel`` and
confirm the job left the queue. A provision after a failure always gets a fresh allocation.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from verl_pipeline import auth
from verl_pipeline.cluster.base import (
    RAY_NODE_ENV,
    ClusterBackend,
    ClusterHandle,
    ClusterHealth,
    ClusterStatus,
    probe,
    wait_ready,
)
from verl_pipeline.cluster.settings import Key, absolute_path, environment, read_settings, setting
from verl_pipeline.cluster.slurm_rest import SlurmRest, slurm_rest_end_time, state_of
from verl_pipeline.constants import DEFAULT_AUTH_MODE
from verl_pipeline.exceptions import ClusterError, ConfigError
from verl_pipeline.paths import atomic_path, pipeline_home, short_hash, slug, write_json_atomic
from verl_pipeline.rundir import RunDir, retire

log = logging.getLogger(__name__)

SCRIPT_NAME = "ray-cluster.sbatch"
STATE_FILE = "slurm-job.json"
#: Per-node ports, as offsets from the node's port base (``port_base + port_stride * node_index``).
NODE_PORT_OFFSETS = {
    "--node-manager-port": 0,
    "--object-manager-port": 1,
    "--dashboard-agent-listen-port": 2,
    "--dashboard-agent-grpc-port": 3,
    "--metrics-export-port": 4,
    "--runtime-env-agent-port": 5,
}
WORKER_PORT_OFFSET = 10
WORKER_PORT_SPAN = 80
#: Slurm job states after which the allocation is gone for good.
TERMINAL_STATES = {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
                   "PREEMPTED", "REVOKED", "SPECIAL_EXIT", "TIMEOUT"}
#: Pending reasons that never resolve by waiting: fail at once instead of waiting out pending_timeout_s.
HOPELESS_REASONS = {"PartitionNodeLimit", "PartitionTimeLimit", "PartitionConfig", "PartitionDown", "AccountNotAllowed",
                    "InvalidAccount", "InvalidQOS", "QOSMaxNodePerJobLimit", "QOSMaxGRESPerJob", "BadConstraints",
                    "ReqNodeNotAvail", "JobHeldAdmin", "DependencyNeverSatisfied"}
_NAME = re.compile(r"^[A-Za-z0-9_.:\-]+$")
CONTAINER_RUNTIMES = ("apptainer", "enroot", "docker")


def time_limit_minutes(text: str) -> int | None:
    """Slurm's time limit (``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``, ``D-H:M:S``) in whole minutes,
    rounded up; None for UNLIMITED/INFINITE."""
    if text in ("UNLIMITED", "INFINITE"):
        return None
    days = 0
    rest = text
    if "-" in text:
        d, rest = text.split("-", 1)
        days = int(d) if d.isdigit() else -1
    parts = rest.split(":")
    if days < 0 or not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        raise ConfigError("cluster.time", text, "is not a Slurm time limit", "time: '1-00:00:00' or '04:00:00'")
    n = [int(p) for p in parts]
    if "-" in text:  # D-H, D-H:M, D-H:M:S
        h, m, sec = ([*n, 0, 0])[:3]
    elif len(n) == 3:  # H:M:S
        h, m, sec = n
    else:  # M, M:S
        h, m, sec = 0, n[0], (n[1] if len(n) == 2 else 0)
    return max(days * 1440 + h * 60 + m + (1 if sec else 0), 1)


@dataclass(frozen=True)
class SlurmJob:
    """One look at a Slurm job (``scontrol show job -o``); ``state`` is ``GONE`` once Slurm forgot it."""

    job_id: str
    state: str
    reason: str = ""
    exit_code: str = ""
    nodes: str = ""

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES or self.state == "GONE"

    def describe(self) -> str:
        text = f"Slurm job {self.job_id} is {self.state}"
        if self.reason and self.reason != "None":
            text += f" (reason: {self.reason})"
        if self.exit_code and self.exit_code != "0:0":
            text += f", exit code {self.exit_code}"
        return text


def parse_scontrol_job(text: str) -> dict[str, str]:
    """``Key=Value`` pairs of one ``scontrol show job -o`` line (values may contain spaces only in Command)."""
    out: dict[str, str] = {}
    for m in re.finditer(r"(\w[\w/:]*)=(\S*)", text):
        out.setdefault(m.group(1), m.group(2))
    return out


@dataclass(frozen=True)
class Container:
    runtime: str
    image: str
    mounts: tuple[str, ...] = ()
    shm_size: str = "64g"

    def wrap(self, name: str) -> list[str]:
        """The command prefix that runs a Ray node inside the container with host networking."""
        if self.runtime == "apptainer":
            # Apptainer shares the host network and /dev/shm by default.
            cmd = ["apptainer", "exec", "--nv"]
            for m in self.mounts:
                cmd += ["--bind", m]
            return [*cmd, self.image]
        if self.runtime == "docker":
            # Ray's auth mode and token path from the script's environment (the file is on shared storage).
            cmd = ["docker", "run", "--rm", f"--name={name}", "-e", auth.MODE_VAR, "-e", auth.TOKEN_PATH_VAR,
                   "--network=host", "--ipc=host",
                   f"--shm-size={self.shm_size}", "--gpus=all"]
            for m in self.mounts:
                cmd += ["-v", m]
            return [*cmd, self.image]
        # enroot through Slurm's pyxis plugin: container flags go to srun itself.
        flags = [f"--container-image={self.image}"]
        if self.mounts:
            flags.append(f"--container-mounts={','.join(self.mounts)}")
        return flags


@dataclass(frozen=True)
class SlurmControl:
    """How the pipeline talks to Slurm: its commands (``sbatch``, ``scontrol``, ``squeue``, ``scancel``; from
    ``slurm_bin`` and with ``slurm_conf`` when set) or, with ``rest``, slurmrestd."""

    slurm_bin: str | None = None
    slurm_conf: str | None = None
    rest: SlurmRest | None = None

    def _cmd(self, name: str) -> str:
        if self.slurm_bin:
            return str(Path(self.slurm_bin) / name)
        found = shutil.which(name)
        if not found:
            raise ClusterError(f"the Slurm command `{name}` is not installed on this machine (install slurm-client "
                               "or set cluster.slurm_bin)")
        return found

    def run(self, args: list[str], *, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ)
        if self.slurm_conf:
            env["SLURM_CONF"] = self.slurm_conf
        proc = subprocess.run([self._cmd(args[0]), *args[1:]], capture_output=True, text=True, env=env,
                              timeout=timeout, check=False)
        if check and proc.returncode != 0:
            raise ClusterError(f"`{' '.join(args)}` failed (exit {proc.returncode}): "
                               f"{(proc.stderr or proc.stdout).strip()}")
        return proc

    def submit(self, script: str, script_path: Path, rest_properties: dict[str, Any]) -> str:
        """Submit the allocation: ``sbatch`` of the saved script, or the script and its properties to slurmrestd."""
        if self.rest:
            return self.rest.submit(script, rest_properties)
        out = self.run(["sbatch", "--parsable", str(script_path)]).stdout.strip()
        job_id = out.split(";")[0]
        if not job_id.isdigit():
            raise ClusterError(f"sbatch printed no job id: {out!r}")
        return job_id

    def job(self, job_id: str) -> SlurmJob:
        if self.rest:
            record = self.rest.job(job_id)
            if record is None:
                return SlurmJob(job_id, "GONE", "no longer known to Slurm")
            return SlurmJob(job_id, *state_of(record))
        proc = self.run(["scontrol", "show", "job", "-o", job_id], check=False)
        if proc.returncode != 0:
            if "Invalid job id" in proc.stderr:
                return SlurmJob(job_id, "GONE", "no longer known to Slurm")
            raise ClusterError(f"`scontrol show job {job_id}` failed: {proc.stderr.strip()}")
        info = parse_scontrol_job(proc.stdout)
        return SlurmJob(job_id, info.get("JobState", "UNKNOWN"), info.get("Reason", ""), info.get("ExitCode", ""),
                        info.get("NodeList", ""))

    def jobs_named(self, job_name: str) -> list[str]:
        """The ids of the jobs of this name that have not ended."""
        if self.rest:
            return [str(j["job_id"]) for j in self.rest.jobs_named(job_name)
                    if state_of(j)[0] not in TERMINAL_STATES]
        proc = self.run(["squeue", "-h", f"--name={job_name}", "-o", "%i"])
        return [line.strip() for line in proc.stdout.splitlines() if line.strip()]

    def cancel(self, job_id: str) -> None:
        if self.rest:
            self.rest.cancel(job_id)
        else:
            self.run(["scancel", job_id], check=False)

    def released(self, job: SlurmJob) -> bool:
        """Whether the allocation of ``job`` (one look at it) is gone: ended, and its nodes done with it."""
        # COMPLETING (CG) is terminal for the scheduler but the nodes still run its processes.
        if not job.terminal or "COMPLETING" in job.state:
            return False
        if self.rest:  # its record says COMPLETING until the nodes are done with it
            return True
        in_queue = self.run(["squeue", "-h", "-j", job.job_id, "-o", "%T"], check=False).stdout.strip()
        return not in_queue or in_queue in TERMINAL_STATES

    def end_time(self, job_id: str) -> float | None:
        """When the allocation ends (epoch seconds: Slurm's EndTime), None without a time limit."""
        if self.rest:
            record = self.rest.job(job_id)
            return slurm_rest_end_time(record) if record else None
        proc = self.run(["scontrol", "show", "job", "-o", job_id], check=False)
        return slurm_end_time(parse_scontrol_job(proc.stdout)) if proc.returncode == 0 else None


def _time_limit(key: Key, value: Any) -> str:
    # A whole number is minutes. An unquoted 04:00:00 arrives as one too (YAML 1.1 reads it in base 60:
    # 14400), which is why the profiles quote it.
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise key.refuse(value, "is not a Slurm time limit", "'1-00:00:00' or '04:00:00'")
    time_limit_minutes(str(value))  # raises a ConfigError naming cluster.time when it is not one
    return str(value)


def _extra_sbatch(key: Key, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(a, str) and a.startswith("--") and "\n" not in a
                                              for a in value):
        raise key.refuse(value, "must be a list of sbatch options starting with --", "['--exclusive']")
    return tuple(value)


def _container(key: Key, value: Any) -> Container | None:
    if not value:
        return None
    if not isinstance(value, dict) or value.get("runtime") not in CONTAINER_RUNTIMES or not value.get("image"):
        raise key.refuse(value, f"needs runtime ({'/'.join(CONTAINER_RUNTIMES)}) and image",
                         "{runtime: apptainer, image: /shared/images/verl.sif}")
    unknown = sorted(set(value) - {"runtime", "image", "mounts", "shm_size"})
    if unknown:
        raise ConfigError(f"{key.path}.{unknown[0]}", value[unknown[0]], "unknown container setting",
                          "use runtime, image, mounts, shm_size")
    mounts = value.get("mounts") or []
    if not isinstance(mounts, list) or not all(isinstance(m, str) and ":" in m for m in mounts):
        raise ConfigError(f"{key.path}.mounts", mounts, "must be a list of host:container paths",
                          "mounts: ['/shared:/shared']")
    shm = str(value.get("shm_size", Container.shm_size))
    if not re.fullmatch(r"\d+[kmgKMG]?", shm):
        raise ConfigError(f"{key.path}.shm_size", shm, "must be a size like 64g", "shm_size: 64g")
    return Container(str(value["runtime"]), str(value["image"]), tuple(mounts), shm)


def _port_base(key: Key, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not (value == 0 or 1024 <= value <= 65535):
        raise key.refuse(value, "must be 0 (pick free ports at submit time) or 1024-65535", key.default)
    return value


_PORT = setting(ge=1024, le=65535)
_DIR = setting(parse=absolute_path())


@dataclass(frozen=True)
class SlurmBackend(ClusterBackend):
    """Settings of the ``slurm`` cluster profile (see configs/clusters/slurm-*.yaml)."""

    nodes: int = field(default=1, metadata=setting(ge=1, le=4096))
    cpus_per_node: int = field(default=8, metadata=setting(ge=1, le=4096))
    gpus_per_node: int = field(default=0, metadata=setting(ge=0, le=16))
    time_limit: str = field(default="04:00:00", metadata=setting(key="time", parse=_time_limit))
    partition: str | None = field(default=None, metadata=setting(pattern=_NAME, example="gpu"))
    account: str | None = field(default=None, metadata=setting(pattern=_NAME, example="ml-team"))
    qos: str | None = field(default=None, metadata=setting(pattern=_NAME, example="normal"))
    mem: str | None = field(default=None, metadata=setting(pattern=re.compile(r"\d+[KMGT]?"), example="64G"))
    extra_sbatch: tuple[str, ...] = field(default=(), metadata=setting(parse=_extra_sbatch))
    container: Container | None = field(default=None, metadata=setting(parse=_container))
    env: dict[str, str] = field(default_factory=dict, metadata=setting(parse=environment(
        auth_fix="set cluster.auth_mode: token (a fresh token per allocation) or disabled")))
    python: str | None = field(default=None, metadata=setting(parse=absolute_path(
        rule="must be an absolute path to the nodes' python",
        example="/opt/verl/.venv/bin/python (null = the submitting environment's)")))
    dashboard_host: str = field(default="0.0.0.0", metadata=setting(pattern=re.compile(r"[0-9.]+|[A-Za-z0-9.\-]+"),
                                                                     rule="must be an address"))
    gcs_port: int = field(default=6379, metadata=_PORT)
    dashboard_port: int = field(default=8265, metadata=_PORT)
    client_server_port: int = field(default=10001, metadata=_PORT)
    port_base: int = field(default=30000, metadata=setting(parse=_port_base))
    port_stride: int = field(default=0, metadata=setting(ge=0, le=10000))
    object_store_memory_mb: int | None = field(default=None, metadata=setting(ge=80, rule="Ray needs at least 80 MB",
                                                                             example="4096"))
    temp_dir: str | None = field(default=None, metadata=_DIR)
    shared_dir: str | None = field(default=None, metadata=_DIR)
    slurm_conf: str | None = field(default=None, metadata=_DIR)
    slurm_bin: str | None = field(default=None, metadata=_DIR)
    pending_timeout_s: float = field(default=900.0, metadata=setting(gt=0))
    ready_timeout_s: float = field(default=600.0, metadata=setting(gt=0))
    cancel_timeout_s: float = field(default=120.0, metadata=setting(gt=0))
    poll_s: float = field(default=2.0, metadata=setting(gt=0))
    #: Submit, watch and cancel through slurmrestd instead of sbatch/scontrol/scancel.
    rest: SlurmRest | None = field(default=None, metadata=setting(
        key="slurmrestd", parse=lambda _key, value: SlurmRest.from_spec(value)))
    #: Ray's auth (a fresh token per allocation, in the work dir, unless the profile says disabled).
    auth_mode: auth.AuthMode = field(default=DEFAULT_AUTH_MODE, metadata=setting())
    #: Set by :meth:`for_run`: the run directory the script, logs and head address go to.
    run_dir: str | None = None
    kind: str = "slurm"

    # -- configuration -----------------------------------------------------------------------------
    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> SlurmBackend:
        b = read_settings(cls, spec)
        if b.rest and b.extra_sbatch:
            raise ConfigError("cluster.extra_sbatch", list(b.extra_sbatch),
                              "slurmrestd does not read #SBATCH lines, so extra sbatch options cannot be passed "
                              "through it", "remove extra_sbatch, or submit with sbatch (no slurmrestd setting)")
        if 0 < b.port_stride < WORKER_PORT_OFFSET + WORKER_PORT_SPAN:
            raise ConfigError("cluster.port_stride", b.port_stride,
                              f"nodes sharing a host need at least {WORKER_PORT_OFFSET + WORKER_PORT_SPAN} ports each",
                              f"port_stride: 0 (one node per host) or {WORKER_PORT_OFFSET + WORKER_PORT_SPAN}")
        return b

    def for_run(self, run_dir: Path) -> SlurmBackend:
        return replace(self, run_dir=str(run_dir))

    def _for_handle(self, handle: ClusterHandle) -> SlurmBackend:
        """This backend talking to the Slurm (conf, commands or slurmrestd) that ``handle``'s job is on."""
        extra = handle.extra
        rest = SlurmRest.from_spec(extra["slurmrestd"]) if extra.get("slurmrestd") else self.rest
        return replace(self, slurm_conf=extra.get("slurm_conf") or self.slurm_conf,
                       slurm_bin=extra.get("slurm_bin") or self.slurm_bin, rest=rest,
                       cancel_timeout_s=float(extra.get("cancel_timeout_s") or self.cancel_timeout_s))

    def rest_job_properties(self, name: str) -> dict[str, Any]:
        """The allocation of :meth:`render_script` as slurmrestd job properties (it ignores #SBATCH lines)."""
        workdir = self.workdir_for(name)
        job: dict[str, Any] = {
            "name": self.job_name(name), "nodes": self.nodes, "tasks_per_node": 1,
            "cpus_per_task": self.cpus_per_node, "current_working_directory": str(workdir),
            "standard_output": f"{workdir}/slurm-%j.out", "standard_error": f"{workdir}/slurm-%j.out",
            # The script sets what the Ray nodes need; the job gets a plain environment plus the
            # variables sbatch would have set from its options (the script reads them).
            "environment": {"PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
                            "LANG": os.environ.get("LANG", "C.UTF-8"),
                            "SLURM_CPUS_PER_TASK": str(self.cpus_per_node),
                            "SLURM_GPUS_PER_NODE": str(self.gpus_per_node)},
        }
        minutes = time_limit_minutes(self.time_limit)
        if minutes is not None:
            job["time_limit"] = minutes
        if self.gpus_per_node:
            job["tres_per_node"] = f"gres:gpu:{self.gpus_per_node}"
        for key, value in (("partition", self.partition), ("account", self.account), ("qos", self.qos)):
            if value:
                job[key] = value
        if self.mem:
            units = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}
            number, unit = re.fullmatch(r"(\d+)([KMGT]?)", self.mem).groups()  # type: ignore[union-attr]
            job["memory_per_node"] = max(1, int(int(number) * units[unit or "M"]))
        return job

    # -- names and places ------------------------------------------------------------------------
    def job_name(self, name: str) -> str:
        return f"vp-{slug(name, 24)}-{short_hash(name, length=8)}"

    def workdir_for(self, name: str) -> Path:
        """Where the script, Slurm's output and the published head address go (shared storage).

        The run directory when the backend is bound to a run (storage root must be shared),
        else ``shared_dir``, else the pipeline home.
        """
        if self.run_dir:
            return RunDir(Path(self.run_dir)).slurm_dir
        if self.shared_dir:
            return Path(self.shared_dir).expanduser() / self.job_name(name)
        return pipeline_home() / "slurm" / self.job_name(name)

    def temp_dir_for(self, name: str) -> str:
        # Short: Ray puts unix sockets under it (107-byte limit).
        return self.temp_dir or f"/tmp/vps-{short_hash(name, length=10)}"

    def token_file_for(self, name: str) -> Path | None:
        """Where the allocation's Ray token is kept (shared storage, a 0700 directory), None without auth."""
        if self.auth_mode is not auth.AuthMode.TOKEN:
            return None
        return self.workdir_for(name) / "auth" / auth.TOKEN_FILE

    def python_for_nodes(self) -> str:
        return self.python or sys.executable

    # -- the sbatch script -----------------------------------------------------------------------
    def render_script(self, name: str, *, port_base: int | None = None) -> str:
        """The sbatch script for run ``name`` (pure: no I/O): the allocation (``#SBATCH``), the nodes'
        environment, the head then the workers (``srun``), the head address published, the allocation held."""
        workdir = self.workdir_for(name)
        lines = [*_sbatch_options(self, name, workdir), "", "set -uo pipefail", "unset RAY_ADDRESS",
                 *_node_environment(self, name),
                 *_script_variables(self, name, workdir, self.port_base if port_base is None else port_base),
                 *_start_nodes(self, name), *_publish_and_hold(self)]
        return "\n".join(lines)

    # -- Slurm ---------------------------------------------------------------------------------------
    @property
    def control(self) -> SlurmControl:
        """The way to this profile's Slurm: its commands or slurmrestd."""
        return SlurmControl(self.slurm_bin, self.slurm_conf, self.rest)

    def job(self, job_id: str) -> SlurmJob:
        return self.control.job(job_id)

    def jobs_named(self, job_name: str) -> list[str]:
        return self.control.jobs_named(job_name)

    # -- lifecycle -------------------------------------------------------------------------------
    def provision(self, name: str) -> ClusterHandle:
        workdir = self.workdir_for(name)
        job_name = self.job_name(name)
        # A retry (e.g. after a node failure) gets a fresh allocation: release any earlier one first.
        for old in self.jobs_named(job_name):
            log.warning("Cancelling Slurm job %s left by an earlier attempt of %s", old, name)
            self._cancel_and_confirm(old)
        workdir.mkdir(parents=True, exist_ok=True)
        # A fresh token per allocation, written before the script that points Ray at it.
        token_file = self.token_file_for(name)
        if token_file is not None:
            auth.write_token_file(token_file.parent)
        for stale in workdir.glob("head-*.json"):
            # An address published by an earlier allocation must never be mistaken for this one's.
            stale.unlink()
        from verl_pipeline.cluster.local import free_port_range

        base = self.port_base or free_port_range(self.port_stride * self.nodes + WORKER_PORT_OFFSET + WORKER_PORT_SPAN)
        script = self.render_script(name, port_base=base)
        script_path = workdir / SCRIPT_NAME
        with atomic_path(script_path) as tmp:
            tmp.write_text(script)
        log.info("sbatch script %s:\n%s", script_path, script)
        job_id = self.control.submit(script, script_path, self.rest_job_properties(name))
        log.info("Submitted Slurm job %s (%s): %d node(s) x %d CPU / %d GPU", job_id, job_name, self.nodes,
                 self.cpus_per_node, self.gpus_per_node)
        handle = ClusterHandle(
            backend=self.kind, name=name, dashboard_url="", owned=True, auth_mode=self.auth_mode.value,
            token_file=str(token_file) if token_file else None,
            expected_nodes=self.nodes, expected_cpus=self.nodes * self.cpus_per_node,
            expected_gpus=self.nodes * self.gpus_per_node,
            extra={"job_id": job_id, "job_name": job_name, "workdir": str(workdir), "script": str(script_path),
                   "output": str(workdir / f"slurm-{job_id}.out"), "slurm_conf": self.slurm_conf,
                   "slurm_bin": self.slurm_bin, "cancel_timeout_s": self.cancel_timeout_s,
                   "slurmrestd": self.rest.to_dict() if self.rest else None,
                   "temp_dir": self.temp_dir_for(name)},
        )
        write_json_atomic(workdir / STATE_FILE, handle.to_dict())
        try:
            self._wait_running(handle)
            head = self._wait_head_file(handle)
            handle.dashboard_url = str(head["dashboard_url"])
            handle.gcs_address = str(head["gcs_address"])
            handle.extra["head_node"] = head.get("head_node")
            handle.extra["head_ip"] = head.get("head_ip")
            write_json_atomic(workdir / STATE_FILE, handle.to_dict())

            def still_starting() -> None:
                job = self.job(job_id)
                if job.state != "RUNNING":
                    raise ClusterError(f"{job.describe()} before Ray was ready. {self._output_tail(handle)}")

            wait_ready(handle, timeout_s=self.ready_timeout_s, still_starting=still_starting, poll_s=self.poll_s)
        except BaseException:
            self.teardown(handle)
            raise
        return handle

    def _output_tail(self, handle: ClusterHandle, chars: int = 1500) -> str:
        path = Path(handle.extra.get("output", ""))
        if path.is_file():
            return f"Last output of the job ({path}):\n{path.read_text(errors='replace')[-chars:]}"
        return f"The job wrote no output at {path}."

    def _wait_running(self, handle: ClusterHandle) -> None:
        job_id = handle.extra["job_id"]
        deadline = time.monotonic() + self.pending_timeout_s
        while True:
            job = self.job(job_id)
            if job.state == "RUNNING":
                log.info("Slurm job %s is RUNNING on %s", job_id, job.nodes)
                return
            if job.terminal:
                raise ClusterError(f"{job.describe()}: the allocation failed before Ray started. "
                                   f"{self._output_tail(handle)}")
            if job.reason.split(",")[0] in HOPELESS_REASONS:
                raise ClusterError(f"{job.describe()}: Slurm can never start this allocation as requested "
                                   "(check cluster.nodes/cpus_per_node/gpus_per_node/time/partition/account "
                                   "against `sinfo` and your site's limits)")
            if time.monotonic() > deadline:
                raise ClusterError(f"{job.describe()} after {self.pending_timeout_s:.0f}s: gave up waiting for the "
                                   "allocation (raise cluster.pending_timeout_s, or pick another partition/size)")
            time.sleep(self.poll_s)

    def _wait_head_file(self, handle: ClusterHandle) -> dict[str, Any]:
        job_id = handle.extra["job_id"]
        path = Path(handle.extra["workdir"]) / f"head-{job_id}.json"
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            if path.is_file():
                data: dict[str, Any] = json.loads(path.read_text())
                log.info("Slurm job %s published its Ray head: %s (dashboard %s)", job_id, data.get("head_ip"),
                         data.get("dashboard_url"))
                return data
            job = self.job(job_id)
            if job.state != "RUNNING":
                raise ClusterError(f"{job.describe()} before it published the Ray head address. "
                                   f"{self._output_tail(handle)}")
            if time.monotonic() > deadline:
                raise ClusterError(f"Slurm job {job_id} published no Ray head address at {path} within "
                                   f"{self.ready_timeout_s:.0f}s. {self._output_tail(handle)}")
            time.sleep(self.poll_s / 2)

    def _cancel_and_confirm(self, job_id: str, timeout_s: float | None = None) -> SlurmJob:
        timeout_s = self.cancel_timeout_s if timeout_s is None else timeout_s
        control = self.control
        control.cancel(job_id)
        deadline = time.monotonic() + timeout_s
        while True:
            job = control.job(job_id)
            if control.released(job):
                return job
            if time.monotonic() > deadline:
                raise ClusterError(f"{job.describe()}: still in the queue {timeout_s:.0f}s after scancel")
            time.sleep(0.5)

    def teardown(self, handle: ClusterHandle) -> dict[str, Any]:
        b = self._for_handle(handle)
        job_id = str(handle.extra.get("job_id") or "")
        if not job_id:
            return {"slurm_job_id": None, "stopped_processes": 0}
        t0 = time.monotonic()
        before = b.job(job_id)
        final = b._cancel_and_confirm(job_id)
        log.info("Slurm job %s (%s) was %s; after scancel: %s in %.1fs", job_id, handle.name, before.state,
                 final.state, time.monotonic() - t0)
        retire(Path(str(handle.extra.get("workdir", ""))) / STATE_FILE)
        return {"slurm_job_id": job_id, "state_before": before.state, "reason_before": before.reason,
                "final_state": final.state, "seconds": round(time.monotonic() - t0, 2)}

    def health(self, handle: ClusterHandle) -> ClusterHealth:
        """Whether the allocation still runs, with the Slurm state and reason when it does not."""
        b = self._for_handle(handle)
        job = b.job(str(handle.extra.get("job_id")))
        if job.state != "RUNNING":
            return ClusterHealth(False, job.state, job.describe(), infrastructure=True)
        return ClusterHealth(True, job.state, job.describe())

    def end_time(self, handle: ClusterHandle) -> float | None:
        """When the allocation ends (epoch seconds: Slurm's EndTime), None without a time limit."""
        return self._for_handle(handle).control.end_time(str(handle.extra.get("job_id")))

    def status(self, handle: ClusterHandle) -> ClusterStatus:
        st = probe(handle.client())
        return replace(st, detail=f"{st.detail}; {self.health(handle).detail}")


# -- the sbatch script, part by part (SlurmBackend.render_script) --------------------------------------------
def _sbatch_options(b: SlurmBackend, name: str, workdir: Path) -> list[str]:
    lines = [
        "#!/bin/bash",
        "# Rendered by verl-pipeline: a Ray cluster held for the run until `scancel`.",
        f"#SBATCH --job-name={b.job_name(name)}",
        f"#SBATCH --nodes={b.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --cpus-per-task={b.cpus_per_node}",
        f"#SBATCH --time={b.time_limit}",
        f"#SBATCH --output={workdir}/slurm-%j.out",
        f"#SBATCH --chdir={workdir}",
    ]
    if b.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={b.gpus_per_node}")
    for flag, value in (("partition", b.partition), ("account", b.account), ("qos", b.qos), ("mem", b.mem)):
        if value:
            lines.append(f"#SBATCH --{flag}={value}")
    return lines + [f"#SBATCH {arg}" for arg in b.extra_sbatch]


def _node_environment(b: SlurmBackend, name: str) -> list[str]:
    q = shlex.quote
    env = {**RAY_NODE_ENV, **b.env}
    lines = [f"export {k}={q(v)}" for k, v in env.items()]
    # Every node (and every job driver, which inherits the raylet's environment) reads the token file.
    for k, v in auth.ray_env(b.auth_mode, b.token_file_for(name)).items():
        lines.append(f"export {k}={q(v)}" if v is not None else f"unset {k}")
    return lines


def _script_variables(b: SlurmBackend, name: str, workdir: Path, port_base: int) -> list[str]:
    """The script's variables: Ray and its Python, the ports, the node list, the head's IP, each node's ports."""
    q = shlex.quote
    py = b.python_for_nodes()
    return [
        f"PY={q(py)}",
        f"RAY={q(str(Path(py).parent / 'ray'))}",
        # Job entrypoints run `python …` through a shell on the head: make it this environment's.
        'export PATH="$(dirname "$PY"):$PATH"',
        f"WORKDIR={q(str(workdir))}",
        f"TEMP_DIR={q(b.temp_dir_for(name))}",
        f"GCS_PORT={b.gcs_port}",
        f"DASHBOARD_PORT={b.dashboard_port}",
        f"PORT_BASE={port_base}",
        f"PORT_STRIDE={b.port_stride}",
        "",
        'echo "verl-pipeline: Slurm job $SLURM_JOB_ID on $SLURM_JOB_NODELIST"',
        'mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        'HEAD=${NODES[0]}',
        "# The head's address, resolved on the head host (never guessed from the node name).",
        'HEAD_IP=$(srun --overlap --nodes=1 --ntasks=1 -w "$HEAD" hostname -I 2>/dev/null | awk \'{print $1}\')',
        'if [ -z "$HEAD_IP" ]; then',
        '  HEAD_IP=$(srun --overlap --nodes=1 --ntasks=1 -w "$HEAD" hostname --ip-address | awk \'{print $1}\')',
        "fi",
        'if [ -z "$HEAD_IP" ]; then echo "verl-pipeline: cannot resolve the IP of $HEAD" >&2; exit 3; fi',
        'CPUS=${SLURM_CPUS_PER_TASK:-' + str(b.cpus_per_node) + '}',
        'GPUS=${SLURM_GPUS_PER_NODE:-0}; GPUS=${GPUS##*:}',
        'node_ports() {  # distinct ports per node when several nodes share a host (port_stride > 0)',
        '  local b=$((PORT_BASE + PORT_STRIDE * $1))',
        "  echo " + " ".join(f"{flag}=$((b + {off}))" for flag, off in NODE_PORT_OFFSETS.items())
        + f" --min-worker-port=$((b + {WORKER_PORT_OFFSET}))"
        + f" --max-worker-port=$((b + {WORKER_PORT_OFFSET + WORKER_PORT_SPAN - 1}))",
        "}",
    ]


def _start_nodes(b: SlurmBackend, name: str) -> list[str]:
    """The head (``srun`` on the first host, in the container when there is one), then each worker once the
    head's GCS accepts connections."""
    q = shlex.quote
    osm = f" --object-store-memory={b.object_store_memory_mb * 1024 * 1024}" if b.object_store_memory_mb else ""
    common = f'--block --disable-usage-stats --num-cpus="$CPUS" --num-gpus="$GPUS"{osm}'
    srun = "srun --overlap --nodes=1 --ntasks=1 --kill-on-bad-exit=1"
    if b.container and b.container.runtime == "enroot":
        srun += " " + " ".join(q(a) for a in b.container.wrap(""))
    wrap = ""
    if b.container and b.container.runtime != "enroot":
        wrap = " ".join(q(a) for a in b.container.wrap(f"vp-ray-{short_hash(name, length=8)}")) + " "
    return [
        'echo "verl-pipeline: Ray head on $HEAD ($HEAD_IP), workers on ${NODES[*]:1}"',
        f'{srun} -w "$HEAD" {wrap}"$RAY" start --head --node-ip-address="$HEAD_IP" --port="$GCS_PORT" \\',
        f'  --dashboard-host={q(b.dashboard_host)} --dashboard-port="$DASHBOARD_PORT" '
        f'--ray-client-server-port={b.client_server_port} \\',
        f'  --temp-dir="$TEMP_DIR" {common} $(node_ports 0) &',
        "PIDS=($!)",
        "# Workers join once the head's GCS accepts connections.",
        "for _ in $(seq 1 300); do",
        '  (exec 3<>"/dev/tcp/$HEAD_IP/$GCS_PORT") 2>/dev/null && break',
        '  kill -0 "${PIDS[0]}" 2>/dev/null || { echo "verl-pipeline: the Ray head exited" >&2; exit 4; }',
        "  sleep 1",
        "done",
        'for ((i = 1; i < ${#NODES[@]}; i++)); do',
        f'  {srun} -w "${{NODES[$i]}}" {wrap}"$RAY" start --address="$HEAD_IP:$GCS_PORT" \\',
        f'    {common} $(node_ports "$i") &',
        "  PIDS+=($!)",
        "done",
    ]


def _publish_and_hold(b: SlurmBackend) -> list[str]:
    """The head address published on shared storage for the pipeline; the allocation held until scancel."""
    url_host = '"$HEAD_IP"' if b.dashboard_host in ("0.0.0.0", "::") else shlex.quote(b.dashboard_host)
    return [
        "# Publish the head address on shared storage (atomically) for the pipeline to read.",
        f"DASH_HOST={url_host}",
        'HEAD_FILE="$WORKDIR/head-$SLURM_JOB_ID.json"',
        'printf \'{"job_id": "%s", "head_node": "%s", "head_ip": "%s", "gcs_address": "%s:%s", '
        '"dashboard_url": "http://%s:%s", "nodes": %s}\\n\' \\',
        '  "$SLURM_JOB_ID" "$HEAD" "$HEAD_IP" "$HEAD_IP" "$GCS_PORT" "$DASH_HOST" "$DASHBOARD_PORT" '
        '"${#NODES[@]}" > "$HEAD_FILE.tmp"',
        'mv "$HEAD_FILE.tmp" "$HEAD_FILE"',
        "# Hold the allocation until teardown (scancel); if any Ray node exits, release it.",
        "wait -n",
        'echo "verl-pipeline: a Ray node exited: releasing the allocation" >&2',
        "exit 5",
        "",
    ]


def slurm_end_time(fields: dict[str, str]) -> float | None:
    """``EndTime`` of ``scontrol show job -o`` fields (the local time scontrol prints), None when unknown."""
    text = fields.get("EndTime", "")
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None  # "Unknown" (no time limit), "None"
