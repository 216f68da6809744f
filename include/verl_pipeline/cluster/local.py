"""The embedded default: Ray nodes started on this machine, on loopback, owned by the pipeline.

One head node, plus ``nodes - 1`` worker nodes joined to it (several Ray nodes on one host, each
with its own ports, for multi-node and node-failure tests). Worker nodes carry the custom resource
``local_worker_node`` so work can be placed on them. Nodes with GPUs on one host each get GPUs of their
own (``CUDA_VISIBLE_DEVICES`` of each ``ray start``: :meth:`LocalBackend.node_devices`), so two nodes
never train on one GPU.

``ray start --head --block`` runs as the leader of a new session, so the head and everything it
spawns share one process group. Teardown stops exactly those processes (by PID, process group and
the private temp dir in their command lines) in Ray's order (:func:`stop_stages`): SIGTERM, and SIGKILL
for what outlives one grace period.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from verl_pipeline import auth
from verl_pipeline.cluster import procs
from verl_pipeline.cluster.base import RAY_NODE_ENV, ClusterBackend, ClusterHandle, ClusterHealth, wait_ready
from verl_pipeline.cluster.settings import Key, read_settings, setting
from verl_pipeline.constants import DEFAULT_AUTH_MODE
from verl_pipeline.exceptions import ClusterError, ConfigError
from verl_pipeline.paths import short_hash, slug, write_json_atomic
from verl_pipeline.rundir import retire

log = logging.getLogger(__name__)

#: Every port a Ray node opens, by ``ray start`` flag. 0 in a profile means "pick a free one".
PORT_FLAGS = {
    "gcs": "--port",
    "dashboard": "--dashboard-port",
    "dashboard_agent_listen": "--dashboard-agent-listen-port",
    "dashboard_agent_grpc": "--dashboard-agent-grpc-port",
    "node_manager": "--node-manager-port",
    "object_manager": "--object-manager-port",
    "metrics_export": "--metrics-export-port",
    "runtime_env_agent": "--runtime-env-agent-port",
    "ray_client_server": "--ray-client-server-port",
}
_WORKER_PORT_SPAN = 200
#: The ports a Ray client server hands its clients, in order, without checking the host (Ray 2.60,
#: ``ray/util/client/server/proxier.py``: MIN/MAX_SPECIFIC_SERVER_PORT). A worker of another cluster
#: on one of them would keep that client's server from binding its port.
RAY_CLIENT_SERVER_PORTS = range(23000, 24000)
#: Ports only the head opens (worker nodes join the head's GCS and have no dashboard).
_HEAD_ONLY_PORTS = {"gcs", "dashboard", "ray_client_server"}
STATE_FILE = "verl_pipeline_cluster.json"
#: Environment variable naming the cluster (its temp dir) in every process the cluster runs.
CLUSTER_MARKER = "VERL_PIPELINE_CLUSTER"
#: The GPUs a process may use (CUDA's, which Ray reads at ``ray start`` and hands out from).
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
#: Attempts to start a local cluster when ``ray start`` failed in a way a second start gets past.
_START_ATTEMPTS = 3
#: What ``ray start`` prints when a port it was given is taken or given twice, or when its GCS did not
#: answer in time on a loaded host (seen in CI: a re-provision while other tests start clusters).
_RETRYABLE_START_MARKERS = ("Failed to bind", "already in use", "is used by other components",
                            "timed out during startup")

#: How often a starting cluster is asked whether it is ready: two requests on loopback, and each
#: second of a local start is a second of `make run`.
_READY_POLL_S = 0.2


class _RetryableStart(ClusterError):
    """``ray start`` exited for a reason a fresh start (fresh ports) gets past: a port taken, a slow GCS."""


def free_ports(count: int, exclude: Collection[int] = ()) -> list[int]:
    """``count`` distinct ports that are free right now, none of them in ``exclude``.

    Every socket stays bound until all are picked: asking the kernel for one free port at a time can
    hand out the same port twice (it was free again the moment its probe socket closed), and Ray
    refuses to start when two of its components are given one port.
    """
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < count:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(s)
            s.bind(("0.0.0.0", 0))
            port = int(s.getsockname()[1])
            if port not in exclude:
                ports.append(port)
            if len(held) > count + 100:
                raise ClusterError(f"could not find {count} free ports on this machine")
    finally:
        for s in held:
            s.close()
    return ports


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (outgoing connections take ports from there)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _port_free(port: int) -> bool:
    # The wildcard address: a port that any address of this host holds (loopback or the node IP) is taken.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def free_port_range(span: int, exclude: tuple[int, ...] = (), low: int = 10000) -> int:
    """The first port of ``span`` consecutive ports that are all free right now.

    Below the ephemeral range (so outgoing connections never take them later), clear of the Ray
    client server's ports (:data:`RAY_CLIENT_SERVER_PORTS`), every port probed on the wildcard
    address, and the slot picked at random: clusters that reserved a range for workers they have not
    started yet (nothing bound to probe) rarely get the same slot. ``exclude`` are bases already
    handed out for this cluster.
    """
    high = _ephemeral_start() - span
    bases = list(range(low, high + 1, span))
    random.SystemRandom().shuffle(bases)
    for base in bases:
        if any(abs(base - other) < span for other in exclude):
            continue
        if base < RAY_CLIENT_SERVER_PORTS.stop and base + span > RAY_CLIENT_SERVER_PORTS.start:
            continue
        if all(_port_free(port) for port in range(base, base + span)):
            return base
    raise ClusterError(f"no free range of {span} ports between {low} and {high + span} on this machine")


def ray_executable() -> str:
    """The ``ray`` CLI of the running interpreter's environment."""
    candidate = Path(sys.executable).parent / "ray"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("ray")
    if not found:
        raise ClusterError("the `ray` command is not installed: pip install 'ray[default]'")
    return found


def _gpu_devices(key: Key, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in value):
        raise key.refuse(value, "must list GPU indices as nvidia-smi numbers them, num_gpus per node in node order",
                         "[0, 1, 2, 3]")
    if len(set(value)) != len(value):
        raise key.refuse(value, "names a GPU twice: each GPU belongs to one node", sorted(set(value)))
    return tuple(value)


def _ports(key: Key, value: Any) -> dict[str, int]:
    if not isinstance(value, dict):
        raise key.refuse(value, "must map Ray ports to numbers", "{gcs: 0, dashboard: 0}")
    for name, port in value.items():
        if name not in PORT_FLAGS:
            raise ConfigError(f"{key.path}.{name}", port, "unknown Ray port", f"use one of {sorted(PORT_FLAGS)}")
        if isinstance(port, bool) or not isinstance(port, int) or not (port == 0 or 1024 <= port <= 65535):
            raise ConfigError(f"{key.path}.{name}", port, "must be 0 (pick a free port) or 1024-65535", f"{name}: 0")
    return dict(value)


@dataclass(frozen=True)
class LocalBackend(ClusterBackend):
    """Start ``nodes`` Ray nodes (a head + workers) on this machine, on loopback, with explicit
    resources and ports."""

    num_cpus: int = field(default=2, metadata=setting(ge=1, rule="a Ray head needs at least 1 CPU (an integer)"))
    num_gpus: int = field(default=0, metadata=setting(ge=0))
    nodes: int = field(default=1, metadata=setting(
        ge=1, le=8, rule="the local backend runs 1 to 8 Ray nodes on this machine (an integer)"))
    object_store_memory_mb: int = field(default=512, metadata=setting(
        ge=80, rule="Ray needs at least 80 MB of object store (an integer)"))
    ready_timeout_s: float = field(default=120.0, metadata=setting(gt=0))
    temp_dir: str | None = field(default=None, metadata=setting(example="/tmp/vp-ray"))
    ports: dict[str, int] = field(default_factory=dict, metadata=setting(parse=_ports))
    min_worker_port: int = field(default=0, metadata=setting(ge=0, le=65535))
    stop_grace_s: float = field(default=10.0, metadata=setting(ge=0))
    #: Ray's auth (a fresh token per start, in a 0600 file beside the temp dir, unless the profile says disabled).
    auth_mode: auth.AuthMode = field(default=DEFAULT_AUTH_MODE, metadata=setting())
    #: The host's GPUs the nodes use (nvidia-smi's numbers), ``num_gpus`` each in node order; empty: see
    #: :meth:`node_devices`.
    gpu_devices: tuple[int, ...] = field(default=(), metadata=setting(parse=_gpu_devices))
    kind: str = "local"

    def __post_init__(self) -> None:
        want = self.nodes * self.num_gpus
        if self.gpu_devices and len(self.gpu_devices) != want:
            fix = f"gpu_devices: {list(range(want))}" if want else "gpu_devices: [] (num_gpus is 0)"
            raise ConfigError("cluster.gpu_devices", list(self.gpu_devices),
                              f"lists {len(self.gpu_devices)} GPU(s); {self.nodes} node(s) x num_gpus {self.num_gpus} "
                              f"use {want}", fix)

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> LocalBackend:
        return read_settings(cls, spec)

    def node_devices(self, environ: Mapping[str, str]) -> list[str | None]:
        """Each node's ``CUDA_VISIBLE_DEVICES`` by rank (None: the node inherits the caller's).

        ``gpu_devices`` when the profile lists them; else, for several nodes with GPUs, the GPUs the
        caller sees (its ``CUDA_VISIBLE_DEVICES``, else 0, 1, …) split in order, ``num_gpus`` per node:
        each ``ray start`` would otherwise offer the same first GPUs of the host as its own. One node
        keeps the caller's GPUs.
        """
        n = self.num_gpus
        if self.gpu_devices:
            ids = [str(d) for d in self.gpu_devices]
        elif self.nodes > 1 and n > 0:
            visible = environ.get(CUDA_VISIBLE_DEVICES)
            ids = ([d.strip() for d in visible.split(",") if d.strip()] if visible is not None
                   else [str(i) for i in range(self.nodes * n)])
            if len(ids) < self.nodes * n:
                raise ClusterError(f"{self.nodes} local Ray nodes x {n} GPU(s) need {self.nodes * n} GPUs, but "
                                   f"{CUDA_VISIBLE_DEVICES}={visible} names {len(ids)} (fix: cluster.gpu_devices, "
                                   "or fewer nodes or num_gpus)")
        else:
            return [None] * self.nodes
        return [",".join(ids[rank * n:(rank + 1) * n]) for rank in range(self.nodes)]

    def temp_dir_for(self, name: str) -> Path:
        # Short on purpose: Ray puts unix sockets under it and socket paths are limited to 107 bytes.
        if self.temp_dir:
            return Path(self.temp_dir).expanduser().resolve()
        return Path("/tmp") / f"vp-{slug(name, 16)}-{short_hash(name, length=8)}"

    @staticmethod
    def token_dir_for(temp_dir: Path) -> Path:
        """The cluster's private (0700) directory for its token file: ``<temp dir>.auth``, beside Ray's
        temp dir. In ``/tmp`` (sticky) nobody else can rename or replace it."""
        return temp_dir.with_name(f"{temp_dir.name}.auth")

    def _env(self, marker: str, token_file: Path | None) -> dict[str, str]:
        # Explicit on the server (and on every client via ClusterHandle.client): without it Ray turns
        # token auth on by itself when ~/.ray/auth_token exists. Every node, and every job driver
        # (they inherit the raylet's environment), reads the token from the file.
        env = auth.apply_env(dict(os.environ), auth.ray_env(self.auth_mode, token_file))
        env.update(RAY_NODE_ENV)
        # Job entrypoints run `python …` through a shell on the head: make it this environment's.
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env.pop("RAY_ADDRESS", None)
        # Inherited by every process of this cluster, job drivers included (see procs.with_environ).
        env[CLUSTER_MARKER] = marker
        return env

    def _start(self, cmd: list[str], log_path: Path, token_file: Path | None,
               devices: str | None) -> subprocess.Popen[bytes]:
        """Start one ``ray start --block`` node (leader of its own session), marked with its cluster,
        working in the cluster's temp dir, on ``devices`` (its ``CUDA_VISIBLE_DEVICES``; None: inherited)."""
        log.info("Starting a local Ray node%s: %s", "" if devices is None else f" on GPUs {devices}", " ".join(cmd))
        # The node's log lives in the cluster's temp dir, which names the cluster.
        temp_dir = log_path.parent
        env = self._env(str(temp_dir), token_file)
        if devices is not None:
            env[CUDA_VISIBLE_DEVICES] = devices
            # The numbers as nvidia-smi (and Ray's GPU readings, NVML) give them, not CUDA's fastest-first order.
            env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        with open(log_path, "ab") as out:
            return subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env=env,
                # Not the caller's directory: every Ray process, and every job driver, inherits it, and
                # a redeployed checkout deletes it (the next driver then fails in os.path.abspath).
                cwd=temp_dir,
                start_new_session=True, close_fds=True,
            )

    def _node_args(self, temp_dir: Path, ports: dict[str, int], worker_base: int) -> list[str]:
        return [
            f"--num-cpus={self.num_cpus}", f"--num-gpus={self.num_gpus}",
            f"--object-store-memory={self.object_store_memory_mb * 1024 * 1024}",
            f"--temp-dir={temp_dir}",
            f"--min-worker-port={worker_base}", f"--max-worker-port={worker_base + _WORKER_PORT_SPAN - 1}",
            "--disable-usage-stats",
        ] + [f"{PORT_FLAGS[key]}={port}" for key, port in ports.items()]

    def provision(self, name: str) -> ClusterHandle:
        """Start the nodes and wait until the cluster is ready. A port taken between picking it and
        Ray binding it (another process got there first), or a node that timed out during startup on
        a loaded host, is retried with fresh ports."""
        for attempt in range(1, _START_ATTEMPTS):
            try:
                return self._provision_once(name)
            except _RetryableStart as exc:
                log.warning("`ray start` failed for %s (attempt %d of %d), retrying with fresh ports: %s",
                            name, attempt, _START_ATTEMPTS, str(exc).splitlines()[-1])
        return self._provision_once(name)

    def _provision_once(self, name: str) -> ClusterHandle:
        temp_dir = self.temp_dir_for(name)
        devices = self.node_devices(os.environ)  # before anything starts: too few GPUs is a one-line error
        leftovers = procs.alive(procs.with_cmdline(str(temp_dir)) + procs.with_environ(CLUSTER_MARKER, str(temp_dir)))
        if leftovers:
            log.warning("Stopping %d leftover Ray processes of an earlier attempt in %s", len(leftovers), temp_dir)
            stop_processes(leftovers, grace_s=self.stop_grace_s)
        # Ours (Ray makes it world-writable once it runs, so the token lives beside it, not in it).
        auth.private_dir(temp_dir, others_may_write=True)
        # A fresh token for every start: one that leaked from an earlier cluster opens nothing.
        token_file = (auth.write_token_file(self.token_dir_for(temp_dir))
                      if self.auth_mode is auth.AuthMode.TOKEN else None)
        handle, started = self._start_head(name, temp_dir, token_file, devices[0])

        def still_starting() -> None:
            for p, path in started:
                if p.poll() is not None:
                    tail = path.read_text(errors="replace")[-2000:]
                    error = _RetryableStart if any(m in tail for m in _RETRYABLE_START_MARKERS) else ClusterError
                    raise error(
                        f"`ray start` exited with code {p.returncode} before the cluster was ready:\n{tail}"
                    )

        try:
            wait_ready(handle, timeout_s=self.ready_timeout_s, still_starting=still_starting, poll_s=_READY_POLL_S)
            if self.nodes > 1:
                started += self._start_workers(handle, temp_dir, token_file, devices)
                wait_ready(handle, timeout_s=self.ready_timeout_s, still_starting=still_starting,
                           poll_s=_READY_POLL_S)
        except BaseException:
            self.teardown(handle)
            raise
        handle.extra["pids"] = [r.to_list() for p, _ in started for r in procs.tree(p.pid)]
        write_json_atomic(temp_dir / STATE_FILE, handle.to_dict())
        return handle

    def _start_head(self, name: str, temp_dir: Path, token_file: Path | None,
                    devices: str | None) -> tuple[ClusterHandle, list[tuple[subprocess.Popen[bytes], Path]]]:
        """Start the head node (on fresh ports, or the profile's pinned ones) and record the cluster's
        handle in its state file before anything waits: a teardown after a crash finds what was started."""
        pinned = {key: port for key, port in self.ports.items() if port}
        fresh = iter(free_ports(len(PORT_FLAGS.keys() - pinned.keys()), exclude=set(pinned.values())))
        ports = {key: pinned.get(key) or next(fresh) for key in PORT_FLAGS}
        worker_base = self.min_worker_port or free_port_range(_WORKER_PORT_SPAN)
        cmd = [
            ray_executable(), "start", "--head", "--block",
            "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1", "--include-dashboard=true",
            *self._node_args(temp_dir, ports, worker_base),
        ]
        log_path = temp_dir / "ray-start-node0.log"
        proc = self._start(cmd, log_path, token_file, devices)
        root = procs.ProcRef(proc.pid, procs.psutil.Process(proc.pid).create_time())
        handle = ClusterHandle(
            backend=self.kind,
            name=name,
            dashboard_url=f"http://127.0.0.1:{ports['dashboard']}",
            owned=True,
            auth_mode=self.auth_mode.value,
            token_file=str(token_file) if token_file else None,
            gcs_address=f"127.0.0.1:{ports['gcs']}",
            expected_nodes=1,
            expected_cpus=self.num_cpus,
            expected_gpus=self.num_gpus,
            extra={
                "temp_dir": str(temp_dir),
                "root": root.to_list(),
                "pgid": proc.pid,
                "ports": ports,
                "worker_ports": [worker_base, worker_base + _WORKER_PORT_SPAN - 1],
                "log": str(log_path),
                "stop_grace_s": self.stop_grace_s,
                "nodes": [{"rank": 0, "root": root.to_list(), "pgid": proc.pid, "log": str(log_path),
                           "gpu_devices": devices}],
            },
        )
        write_json_atomic(temp_dir / STATE_FILE, handle.to_dict())
        return handle, [(proc, log_path)]

    def _start_workers(self, handle: ClusterHandle, temp_dir: Path, token_file: Path | None,
                       devices: list[str | None]) -> list[tuple[subprocess.Popen[bytes], Path]]:
        """Start nodes 1..n-1 against the ready head (each recorded in the state file as it starts) and raise
        the handle's expectations to the whole cluster."""
        head_ip = self._head_ip(handle)
        ports = handle.extra["ports"]
        taken = set(ports.values())
        bases = [handle.extra["worker_ports"][0]]
        handle.gcs_address = f"{head_ip}:{ports['gcs']}"
        started = []
        for rank in range(1, self.nodes):
            keys = [key for key in PORT_FLAGS if key not in _HEAD_ONLY_PORTS]
            # Earlier nodes may not have bound theirs yet: none of their ports either.
            node_ports = dict(zip(keys, free_ports(len(keys), exclude=taken), strict=True))
            taken.update(node_ports.values())
            # A pinned min_worker_port: the next ranges after it; else a free one anywhere.
            base = (self.min_worker_port + rank * _WORKER_PORT_SPAN if self.min_worker_port
                    else free_port_range(_WORKER_PORT_SPAN, exclude=tuple(bases)))
            bases.append(base)
            cmd = [
                ray_executable(), "start", "--block", f"--address={handle.gcs_address}",
                '--resources={"local_worker_node": 1}',
                *self._node_args(temp_dir, node_ports, base),
            ]
            node_log = temp_dir / f"ray-start-node{rank}.log"
            p = self._start(cmd, node_log, token_file, devices[rank])
            started.append((p, node_log))
            ref = procs.ProcRef(p.pid, procs.psutil.Process(p.pid).create_time())
            handle.extra["nodes"].append({"rank": rank, "root": ref.to_list(), "pgid": p.pid, "log": str(node_log),
                                          "gpu_devices": devices[rank]})
            write_json_atomic(temp_dir / STATE_FILE, handle.to_dict())
        handle.expected_nodes = self.nodes
        handle.expected_cpus = self.num_cpus * self.nodes
        handle.expected_gpus = self.num_gpus * self.nodes
        return started

    @staticmethod
    def _head_ip(handle: ClusterHandle) -> str:
        heads = [n for n in handle.client().nodes() if n.alive and n.is_head]
        if not heads:
            raise ClusterError(f"cluster {handle.name} reports no alive head node")
        return heads[0].ip

    def teardown(self, handle: ClusterHandle) -> dict[str, Any]:
        return stop_local(handle)

    def health(self, handle: ClusterHandle) -> ClusterHealth:
        """Every node's ``ray start`` process is alive (seen at once, before Ray's own heartbeat
        timeout marks a dead node), and the Jobs API answers."""
        dead = [n["rank"] for n in handle.extra.get("nodes") or []
                if procs.ProcRef.from_list(n["root"]).process() is None]
        if dead:
            return ClusterHealth(False, "NODE_DEAD", f"Ray node(s) {dead} of {handle.name} are gone",
                                 infrastructure=True)
        return super().health(handle)


class RayProcess(str, Enum):
    """What a process of a local cluster is, as far as the order of stopping it goes."""

    #: A node's raylet: its workers and agents share its fate and exit with it.
    RAYLET = "raylet"
    #: The head's GCS: every other process talks to it while it stops, so it goes after them.
    GCS = "gcs_server"
    #: ``ray start --block``: it only watches its node's processes. On SIGTERM it first drains the node
    #: (Ray's ``RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S``, 30 s by default) before it stops them itself,
    #: so it outlives any grace period; once its node's processes are gone it holds nothing.
    NODE_ROOT = "ray start"
    #: Everything else: job drivers, workers, the dashboard and its modules, agents, monitors.
    OTHER = "other"


def ray_process(cmdline: Sequence[str]) -> RayProcess:
    """What the process running ``cmdline`` is (see :class:`RayProcess`)."""
    if not cmdline:
        return RayProcess.OTHER
    program = Path(cmdline[0]).name
    if program == "raylet":
        return RayProcess.RAYLET
    if program == "gcs_server":
        return RayProcess.GCS
    ray_cli = next((i for i, arg in enumerate(cmdline[:2]) if Path(arg).name == "ray"), None)
    if ray_cli is not None and cmdline[ray_cli + 1:ray_cli + 2] == ["start"] and "--block" in cmdline:
        return RayProcess.NODE_ROOT
    return RayProcess.OTHER


def stop_stages(processes: Mapping[procs.ProcRef, Sequence[str]]) -> list[procs.Stage]:
    """The order in which to stop a local cluster's processes (by command line), as Ray's own
    ``ray stop`` does and then some: the raylets first (their workers and agents exit with them), then
    everything else but the GCS, then the GCS (nothing is left to wait on it), and last the
    ``ray start --block`` processes, with SIGKILL: they ignore SIGTERM for the length of a node drain,
    and by then there is nothing left for them to stop."""
    kinds = {ref: ray_process(cmdline) for ref, cmdline in processes.items()}

    def of(kind: RayProcess) -> tuple[procs.ProcRef, ...]:
        return tuple(sorted((ref for ref, k in kinds.items() if k is kind), key=lambda r: r.pid))

    return [
        procs.Stage("the raylets", of(RayProcess.RAYLET)),
        procs.Stage("the cluster's other processes", of(RayProcess.OTHER)),
        procs.Stage("the GCS", of(RayProcess.GCS)),
        procs.Stage("the `ray start --block` node processes", of(RayProcess.NODE_ROOT), kill=True),
    ]


def stop_processes(refs: Iterable[procs.ProcRef], *, grace_s: float) -> procs.StopReport:
    """Stop the live processes of ``refs`` in :func:`stop_stages` order."""
    return procs.stop_in_stages(stop_stages(procs.cmdlines(procs.alive(refs))), grace_s=grace_s)


def stop_local(handle: ClusterHandle) -> dict[str, Any]:
    """Stop every process of a local cluster. Returns what was stopped; raises if any survive."""
    extra = handle.extra
    temp_dir = str(extra.get("temp_dir", ""))
    grace = float(extra.get("stop_grace_s", LocalBackend.stop_grace_s))
    state = Path(temp_dir) / STATE_FILE if temp_dir else None
    if state and state.exists():
        # The state file may know PIDs that the XCom copy of the handle does not (or the reverse).
        saved = json.loads(state.read_text()).get("extra", {})
        extra = {**saved, **extra, "pids": (extra.get("pids") or []) + (saved.get("pids") or []),
                 "nodes": (extra.get("nodes") or []) + (saved.get("nodes") or [])}
    refs: set[procs.ProcRef] = set()
    roots = [extra["root"]] if extra.get("root") else []
    roots += [n["root"] for n in extra.get("nodes") or [] if n.get("root")]
    pgids = {int(extra["pgid"])} if extra.get("pgid") else set()
    pgids |= {int(n["pgid"]) for n in extra.get("nodes") or [] if n.get("pgid")}
    for item in roots:
        root = procs.ProcRef.from_list(item)
        refs.add(root)
        if root.process() is not None:
            refs.update(procs.tree(root.pid))
    refs.update(procs.ProcRef.from_list(p) for p in extra.get("pids") or [])
    for pgid in pgids:
        refs.update(procs.in_process_group(pgid))
    if temp_dir:
        refs.update(procs.with_cmdline(temp_dir))
        refs.update(procs.with_environ(CLUSTER_MARKER, temp_dir))
    t0 = time.monotonic()
    first = stop_processes(refs, grace_s=grace)
    # Agents and workers re-parent when the raylet dies, and a job driver runs in a session of its own:
    # look once more by process group, temp dir and marker.
    late: set[procs.ProcRef] = set()
    for pgid in pgids:
        late.update(procs.in_process_group(pgid))
    if temp_dir:
        late.update(procs.with_cmdline(temp_dir))
        late.update(procs.with_environ(CLUSTER_MARKER, temp_dir))
    again = stop_processes(late, grace_s=grace)
    left = first.left + again.left
    if left:
        raise ClusterError(f"Ray processes survived SIGKILL: {sorted(r.pid for r in left)}")
    if state:
        # Kept for the record (and Ray's session logs stay beside it), but no longer "the live cluster".
        retire(state)
    stopped, late_kills = first.stopped + again.stopped, first.killed_after_grace + again.killed_after_grace
    seconds = round(time.monotonic() - t0, 2)
    log.info("Stopped local Ray cluster %s: %d processes in %.1fs%s", handle.name, stopped, seconds,
             f" ({len(late_kills)} needed SIGKILL after the grace period)" if late_kills else "")
    return {"stopped_processes": stopped, "seconds": seconds, "killed_after_grace": len(late_kills)}
