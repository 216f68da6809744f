"""A throwaway single-host Slurm (munged + slurmctld + N slurmd "nodes") for the tests.

Installs Debian's ``slurmctld slurmd slurm-client munge`` when missing (root + apt only; otherwise
the tests skip, or fail when ``$CI`` is set). Everything lives in a private directory with its own
munge key/socket and free ports; ``stop`` signals exactly the PIDs started here.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from verl_pipeline.cluster.local import free_ports

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge", "slurmrestd"]


def _unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"Slurm test cluster unavailable in CI: {reason}")
    pytest.skip(reason)


def ensure_installed() -> None:
    if all(shutil.which(c) for c in ("slurmctld", "slurmd", "sbatch", "munged", "slurmrestd")):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        _unavailable("Slurm is not installed and this is not a root Debian machine with apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    lock = ["-o", "DPkg::Lock::Timeout=600"]
    subprocess.run(["apt-get", *lock, "update", "-qq"], check=False, env=env, capture_output=True)
    proc = subprocess.run(["apt-get", *lock, "install", "-y", "-qq", "--no-install-recommends", *PACKAGES],
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not shutil.which("slurmctld"):
        _unavailable(f"apt-get install {' '.join(PACKAGES)} failed: {proc.stderr[-1000:]}")


@dataclass
class SlurmCluster:
    root: Path
    nodes: int
    cpus_per_node: int
    conf: Path = field(init=False)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    munged_pid: int | None = None
    #: slurmrestd's UNIX socket once :meth:`start_rest` ran.
    rest_socket: str | None = None

    def __post_init__(self) -> None:
        self.conf = self.root / "etc" / "slurm.conf"

    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(args), capture_output=True, text=True, env=self.env(), timeout=30)

    def start(self) -> None:
        d = self.root
        for sub in ("etc", "state", "log", "run", "munge", "spool"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        host = socket.gethostname().split(".")[0]
        ctld_port, *node_ports = free_ports(1 + self.nodes)
        node_lines = []
        for i, node_port in enumerate(node_ports, start=1):
            node_lines.append(f"NodeName=c{i} NodeHostname={host} NodeAddr=127.0.0.1 Port={node_port} "
                              f"CPUs={self.cpus_per_node} RealMemory=4000 State=UNKNOWN")
        self.conf.write_text("\n".join([
            "ClusterName=vptest",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge",
            f"AuthInfo=socket={d}/munge/munge.socket.2",
            f"StateSaveLocation={d}/state",
            f"SlurmdSpoolDir={d}/spool/%n",
            f"SlurmctldPidFile={d}/run/slurmctld.pid",
            f"SlurmdPidFile={d}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={d}/log/slurmctld.log",
            f"SlurmdLogFile={d}/log/slurmd-%n.log",
            "SlurmdParameters=config_overrides",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "MpiDefault=none",
            "MailProg=/bin/true",
            "ReturnToService=2",
            "MinJobAge=300",
            # Ray ignores SIGTERM for seconds: SIGKILL follows scancel's SIGTERM after 3 s.
            "KillWait=3",
            # A slurmd starved by a busy machine must not be marked DOWN (its jobs would be killed).
            "SlurmdTimeout=300",
            *node_lines,
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
            "",
        ]))
        m = d / "munge"
        m.chmod(0o711)
        key = m / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        subprocess.run(["munged", "--force", f"--key-file={key}", f"--socket={m}/munge.socket.2",
                        f"--pid-file={m}/munged.pid", f"--log-file={m}/munged.log", f"--seed-file={m}/munged.seed"],
                       check=True, capture_output=True)
        self.munged_pid = int((m / "munged.pid").read_text().strip())
        log = open(d / "log" / "daemons.out", "ab")
        self.procs.append(subprocess.Popen(["slurmctld", "-D", "-f", str(self.conf)], stdout=log, stderr=log,
                                           env=self.env(), start_new_session=True))
        for i in range(1, self.nodes + 1):
            (d / "spool" / f"c{i}").mkdir(exist_ok=True)
            self.procs.append(subprocess.Popen(["slurmd", "-D", "-N", f"c{i}", "-f", str(self.conf)], stdout=log,
                                               stderr=log, env=self.env(), start_new_session=True))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            out = self.run("sinfo", "-h", "-N", "-t", "idle", "-o", "%N").stdout.split()
            if len(set(out)) >= self.nodes:
                return
            time.sleep(0.3)
        logs = "\n".join(p.read_text(errors="replace")[-1500:] for p in (d / "log").glob("*"))
        self.stop()
        raise RuntimeError(f"Slurm did not become idle:\n{logs}")

    def start_rest(self) -> str:
        """slurmrestd on a UNIX socket with rest_auth/local (munge); its socket path.

        slurmrestd refuses to run as root: it drops to ``nobody`` (so jobs it submits run as ``nobody``).
        Only the openapi/v0.0.38 plugin: the accounting ones need a slurmdbd this Slurm does not have.
        """
        if not shutil.which("slurmrestd"):
            _unavailable("slurmrestd is not installed")
        rest_dir = self.root / "rest"
        rest_dir.mkdir(exist_ok=True)
        rest_dir.chmod(0o777)  # it binds the socket as `nobody`
        sock = rest_dir / "slurmrestd.socket"
        for d in (self.root, self.conf.parent):  # slurmrestd drops to `nobody`: it must read slurm.conf
            d.chmod(0o755)
        self.conf.chmod(0o644)
        log = open(self.root / "log" / "slurmrestd.out", "ab")
        cmd = ["slurmrestd", "-f", str(self.conf), "-a", "rest_auth/local", "-s", "openapi/v0.0.38", "-u", "nobody",
               f"unix:{sock}"]
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=self.env(), start_new_session=True)
        self.procs.append(proc)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and proc.poll() is None:
            if sock.exists():
                self.rest_socket = str(sock)
                return self.rest_socket
            time.sleep(0.2)
        raise RuntimeError(f"slurmrestd did not start: {(self.root / 'log' / 'slurmrestd.out').read_text()[-1500:]}")

    def stop(self) -> None:
        # Any job still running first, then the daemons in reverse order, then munged.
        if self.procs and self.procs[0].poll() is None:
            self.run("scancel", "--full", "--partition=debug")
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for p in reversed(self.procs):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        if self.munged_pid:
            try:
                proc = psutil.Process(self.munged_pid)
                proc.terminate()
                proc.wait(timeout=10)
            except psutil.NoSuchProcess:
                pass
        self.procs.clear()
        self.munged_pid = None


def processes_of_job(job_id: str) -> list[int]:
    """Live processes started for a Slurm job (their environment names it): none may survive teardown."""
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get("SLURM_JOB_ID") == job_id and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


def slurm_cluster(nodes: int = 2, cpus_per_node: int = 2) -> Iterator[SlurmCluster]:
    ensure_installed()
    cluster = SlurmCluster(Path(tempfile.mkdtemp(prefix="vp-slurm-")), nodes, cpus_per_node)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(cluster.root, ignore_errors=True)
