"""Why did a Ray job fail: the infrastructure (retry, resume) or the user's code/config (fail now)?

Decided from the job's status message and the tail of its logs. Patterns are checked in order:
GPU memory running out first (a CUDA out-of-memory error kills the actor that raised it, which then
reads like a lost worker, and a retry with the same batch sizes and memory share runs out again),
then infrastructure signatures (a node death surfaces as an exception in user code too), then the
user's. Anything unrecognised counts as the user's: retrying a deterministic failure wastes GPUs.

The evidence is the exception that ended the job — the last exception line of the log — whenever it
fits the reason, not the first line that matched: a verl log is full of harmless warnings that name
exceptions (``torchtitan engine is not available: ImportError …``) long before the one that killed it.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any


class FailureKind(str, Enum):
    INFRASTRUCTURE = "infrastructure"
    USER = "user"


@dataclass(frozen=True)
class Classification:
    kind: FailureKind
    reason: str
    evidence: str
    #: What to change, when the reason alone does not say it.
    remedy: str = ""

    @property
    def retryable(self) -> bool:
        return self.kind is FailureKind.INFRASTRUCTURE

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["kind"] = self.kind.value
        return d


#: A GPU's memory ran out, and what to change. Torch's allocator (``torch.OutOfMemoryError: CUDA out of
#: memory``, older ``torch.cuda.OutOfMemoryError``) or a CUDA call (``CUDA error: out of memory``): less
#: memory per GPU. vLLM finding no room for its KV cache within its share (its weights and activations
#: took it all): a larger share. Not Ray's ``ray.exceptions.OutOfMemoryError`` (host memory, below).
_GPU_OOM_REASON = "GPU out of memory"
_GPU_OOM: list[tuple[str, str]] = [
    (r"No available memory for the cache blocks",
     "raise actor_rollout_ref.rollout.gpu_memory_utilization (vLLM's share of each GPU: its weights and "
     "activations left no room for the KV cache) as far as the training state beside it allows, or free the GPU "
     "of other processes; `verl-pipeline render` shows the share the scaling rules chose and its cap"),
    (r"CUDA out of memory|CUDA error: out of memory",
     "lower actor_rollout_ref.rollout.gpu_memory_utilization (vLLM's share of each GPU) or the model profile's "
     "scaling.max_micro_batch_size_per_gpu / log_prob_micro_batch_size_per_gpu, or set "
     "actor_rollout_ref.actor.fsdp_config.param_offload and optimizer_offload to true; `verl-pipeline render` "
     "shows what the scaling rules chose and why"),
]

#: Infrastructure failures: (reason, pattern, whether the reason spares the nodes). A reason that spares
#: them says nothing against the nodes' GPUs, drivers or packages (a process killed, a message lost, an
#: overloaded head): a restart on the same nodes need not probe them again (:mod:`verl_pipeline.jobs.reprobe`).
#: A lost node comes back under a new Ray node id anyway; an NCCL error may be a GPU or a link going bad.
_INFRA: list[tuple[str, str, bool]] = [
    ("node died", r"NodeDiedError|node .{0,80}(has )?died|The node .{0,120} (is dead|has been marked dead)", False),
    ("actor died with its node", r"ActorDiedError.{0,400}(node|raylet)|owner.{0,40}died", False),
    ("actor unreachable (its node or process is gone)", r"ActorUnavailableError|RPC error: Socket closed|"
                                                        r"rpc_code: 14\b", True),
    ("raylet or GCS lost", r"raylet (died|is dead|crashed)|GCS .{0,40}(unavailable|failed|lost|died)|"
                           r"Failed to connect to GCS|RaySystemError|"
                           r"Job supervisor actor (died|could not be scheduled)", False),
    ("object lost with its node", r"ObjectLostError|OwnerDiedError|ObjectFetchTimedOutError", True),
    ("worker killed (OOM or signal)", r"OutOfMemoryError|killed by the (Linux )?OOM|memory monitor|"
                                      r"WorkerCrashedError|SIGKILL|exit code (137|-9)\b", True),
    ("NCCL timeout or error", r"NCCL (timeout|error|WARN.*Timeout)|Watchdog caught collective operation timeout|"
                              r"ProcessGroupNCCL.{0,80}(timeout|Timeout)", False),
    ("preempted", r"[Pp]reempt(ed|ion)|spot instance .{0,40}reclaim", False),
    ("Jobs API unreachable", r"Ray Jobs API unreachable|dashboard .{0,60} is unreachable|Connection refused", True),
    # An overloaded head: the GCS answers a driver's (or a node's) call too late. Ray raises it as a
    # plain RuntimeError from ``ray.init``, which would otherwise read as the user's exception. Only
    # the raised forms: Ray also logs a Deadline Exceeded it then retries ("Failed to get node info b'…'").
    ("Ray control plane overloaded (GCS call timed out)",
     r"Error: b'RPC error: Deadline Exceeded'|Exception: The current node timed out during startup", True),
    # verl's resource check counts the GPUs free right now. The pipeline checked the cluster's total
    # before submitting, so fewer free ones means another job holds them for now (a shared cluster).
    ("GPUs held by another job (verl's resource check)", r"Total available GPUs [\d.]+ is less than total "
                                                         r"desired GPUs", True),
]
#: The infrastructure reasons that spare the nodes (see :data:`_INFRA`).
NODES_SPARED = frozenset(reason for reason, _, spares in _INFRA if spares)

_USER: list[tuple[str, str]] = [
    ("configuration rejected", r"ConfigError|VerlConfigError|ValidationError|ConfigAttributeError|"
                               r"MissingMandatoryValue|hydra.errors|Could not override|verl rejected"),
    ("import error", r"ModuleNotFoundError|ImportError"),
    ("data error", r"DataError|FileNotFoundError|ParquetInvalid|ArrowInvalid"),
    ("exception in user code", r"Traceback \(most recent call last\)|AssertionError|ValueError|TypeError|KeyError|"
                               r"RuntimeError|ZeroDivisionError"),
]


#: An exception line as Python prints it last in a traceback, also behind Ray's ``(Actor pid=N)`` prefix.
_EXCEPTION_LINE = re.compile(r"^(?:\([^)\n]*pid=\d+[^)\n]*\)\s*)?(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*"
                             r"(?:Error|Exception|Exit|Interrupt|Timeout)(?:\([\w.]+\))?(?::.*)?$", re.MULTILINE)


def final_exception(text: str) -> str | None:
    """The last exception line of ``text`` (what ended the job, when it ended by an exception)."""
    matches = _EXCEPTION_LINE.findall(text)
    return " ".join(matches[-1].split())[:400] if matches else None


def classify(message: str, log_tail: str = "", *, status: str = "FAILED") -> Classification:
    """Classify a failed (or stopped) job."""
    text = f"{message}\n{log_tail[-20000:]}"
    ending = final_exception(text)
    for pattern, remedy in _GPU_OOM:
        oom = list(re.finditer(pattern, text))
        if oom:
            fits = ending is not None and re.search(pattern, ending)
            return Classification(FailureKind.USER, _GPU_OOM_REASON,
                                  ending if fits and ending else _line(text, oom[-1]), remedy)
    for reason, pattern, _ in _INFRA:
        matches = list(re.finditer(pattern, text))
        if matches:
            fits = ending is not None and re.search(pattern, ending)
            return Classification(FailureKind.INFRASTRUCTURE, reason, ending if fits and ending else
                                  _around(text, matches[-1]))
    if status == "STOPPED":
        # Stopped by someone (teardown, on_kill, a user): not something a retry should undo.
        return Classification(FailureKind.USER, "job was stopped", message[:300])
    if ending is not None:
        reason = next((r for r, pattern in _USER if re.search(pattern, ending)), "exception in user code")
        return Classification(FailureKind.USER, reason, ending)
    for reason, pattern in _USER:
        matches = list(re.finditer(pattern, text))
        if matches:
            return Classification(FailureKind.USER, reason, _around(text, matches[-1]))
    return Classification(FailureKind.USER, "unrecognised failure (not retried)", message[:300])


def _around(text: str, m: re.Match[str], width: int = 160) -> str:
    start = max(0, m.start() - width // 2)
    return " ".join(text[start:m.end() + width // 2].split())


def _line(text: str, m: re.Match[str]) -> str:
    """The log line of ``m``, without Ray's ``(Actor pid=N)`` prefix and its colours."""
    start = text.rfind("\n", 0, m.start()) + 1
    end = text.find("\n", m.end())
    line = re.sub(r"\x1b\[[0-9;]*m", "", text[start:end if end >= 0 else len(text)])
    return " ".join(re.sub(r"^\([^)\n]*pid=\d+[^)\n]*\)\s*", "", line).split())[:400]
