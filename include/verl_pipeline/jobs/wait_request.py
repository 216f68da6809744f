"""One wait on a Ray job, as the wait operator asks for it and the trigger carries it.

:class:`WaitRequest` is the trigger's keyword arguments, each with its default written here and
nowhere else: the wait operator's poll settings default to these, the operator builds one request
per deferral, and the trigger is ``RayJobTrigger(**request.to_dict())``. Airflow stores a deferred
trigger as the kwargs of its ``serialize()`` (JSON in the metadata database) and builds it again
from them in the triggerer, so :meth:`WaitRequest.to_dict` is exactly those kwargs.

Imports nothing heavy: the triggerer and every DAG parse import it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from verl_pipeline.exceptions import ConfigError

#: Settings that must be above 0 (a zero poll interval would busy-loop the triggerer) or at least 0.
_POSITIVE = ("poll_interval", "max_poll_errors", "node_grace_polls", "max_read_bytes")
_NOT_NEGATIVE = ("progress_interval", "max_lines_per_poll", "expected_nodes", "total_steps", "log_offset_bytes",
                 "metrics_offset_bytes", "gpu_sample_interval")


@dataclass(frozen=True, kw_only=True)
class WaitRequest:
    """What a waiter on one Ray job is asked to do, and where the previous waiter of it stopped."""

    #: The cluster, as :meth:`verl_pipeline.cluster.base.ClusterHandle.to_dict` writes it.
    cluster: dict[str, Any]
    #: The Ray job's submission id.
    job_id: str
    #: The Airflow connection with the cluster's token (None: the cluster's own token file).
    conn_id: str | None = None
    #: Seconds between two looks at the job.
    poll_interval: float = 5.0
    #: Failed looks in a row (the Jobs API briefly unreachable) that end the wait as ``unreachable``.
    max_poll_errors: int = 12
    #: Ray nodes the cluster was provisioned with (0: not counted, e.g. a cluster the pipeline does not own).
    expected_nodes: int = 0
    #: Polls in a row with fewer nodes alive than ``expected_nodes`` that end the wait as ``node_lost``.
    node_grace_polls: int = 3
    #: Forward the job's new log lines to the task log.
    forward_logs: bool = True
    #: Log lines forwarded per poll; the rest are counted, and the task log says where the full log is.
    max_lines_per_poll: int = 1000
    #: New log bytes read per poll; a waiter further behind jumps ahead (and says how much it skipped).
    max_read_bytes: int = 1024 * 1024
    #: verl's metrics JSONL of the attempt (its file logger), when the triggerer can read it.
    metrics_path: str | None = None
    #: ``trainer.total_training_steps`` (0: unknown; progress then has no percentage or ETA).
    total_steps: int = 0
    #: Seconds between two progress lines in the task log (every step when steps are slower).
    progress_interval: float = 60.0
    #: The hang watchdog's :class:`~verl_pipeline.jobs.watchdog.WatchSettings` as a dict (None: no
    #: watchdog, as for preflight jobs, which have no steps).
    watch: dict[str, Any] | None = None
    #: The run directory, where the waiter saves its cursor and records the GPUs (None: not writable
    #: from the triggerer).
    cursor_dir: str | None = None
    #: Seconds between two GPU samples of a node in the run's ``gpu-usage.jsonl`` (0: none recorded):
    #: often enough that a training window of a few steps holds several. At most one per poll: on a
    #: cluster the pipeline owns they come with the node counts (every other poll: every 10 s at the
    #: default 5 s polls), else from a read of Ray's node summary for them (shared by the waiters of
    #: that cluster).
    gpu_sample_interval: float = 10.0
    #: Bytes of the driver log already forwarded or skipped by earlier waiters (always at a line end).
    log_offset_bytes: int = 0
    #: Bytes of ``metrics_path`` already read.
    metrics_offset_bytes: int = 0
    #: The last progress seen (:meth:`verl_pipeline.jobs.progress.Progress.to_dict`).
    progress: dict[str, Any] | None = None
    #: Start-up phases the job was rendered without (``jobs.startup.phases.skipped_phases``: validation on a resume).
    startup_skipped: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        # The operator builds its request before deferring: a bad setting fails there, not in the triggerer.
        for name in _POSITIVE + _NOT_NEGATIVE:
            value = getattr(self, name)
            positive = name in _POSITIVE
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if not number or value < 0 or (positive and value == 0):
                rule = "must be a number above 0" if positive else "must be a number of at least 0"
                default = WaitRequest.__dataclass_fields__[name].default
                raise ConfigError(f"wait.{name}", value, rule, f"{name}={default!r}, the default")

    def to_dict(self) -> dict[str, Any]:
        """The trigger's keyword arguments (JSON-serializable, as Airflow stores them)."""
        return asdict(self)
