"""Test environment: a throwaway AIRFLOW_HOME and pipeline home, offline hub, explicit Ray auth.

Set at import time, before anything imports Airflow (which reads AIRFLOW_HOME once).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_TMP = Path(tempfile.mkdtemp(prefix="vp-tests-"))
# Nothing of the developer's own environment leaks in: their Airflow settings and config file, a
# profiles folder, a hub token or mirror (a real token would be sent to the fake hub), a proxy that
# would carry loopback calls.
for _name in [n for n in os.environ if n.startswith("AIRFLOW__")] + [
        "AIRFLOW_CONFIG", "VERL_PIPELINE_CONFIGS", "HF_TOKEN", "HF_ENDPOINT", "RAY_ADDRESS"]:
    os.environ.pop(_name, None)
os.environ["HF_HOME"] = str(_TMP / "hf-home")
os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost,::1"
os.environ["AIRFLOW_HOME"] = str(_TMP / "airflow")
os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(REPO / "dags")
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
os.environ["AIRFLOW__CORE__UNIT_TEST_MODE"] = "False"
# Airflow signs the UI's and the tasks' JWTs with HS512 once a secret is set; a 64-byte one, as the stack's
# env-check asks (Airflow's own fallback is 16 random bytes, below what PyJWT accepts without a warning).
os.environ["AIRFLOW__API_AUTH__JWT_SECRET"] = secrets.token_hex(32)
os.environ["VERL_PIPELINE_HOME"] = str(_TMP / "home")
os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ["HF_HUB_OFFLINE"] = "1"

GSM8K_DIR = REPO.parent / "shared" / "data" / "gsm8k"

#: The xdist groups: each runs its tests one after another in one worker, while ``make test`` runs
#: the groups and the other tests side by side. The tests of the session's Airflow stack; those
#: of the throwaway Slurm; and the other integration tests (fault clusters, DAG runs) with the
#: ``serial`` ones (a machine-wide resource such as the Ray client's server ports); the other tests
#: of the real MLflow server (one server for them all).
STACK_GROUP, SLURM_GROUP, SERIAL_GROUP, MLFLOW_GROUP = "stack", "slurm", "serial", "mlflow"


def xdist_group(item: pytest.Item) -> str | None:
    """The group of a test, None for the tests any worker may run at any time."""
    if "airflow_stack" in getattr(item, "fixturenames", ()):
        return STACK_GROUP
    if item.get_closest_marker("integration") or item.get_closest_marker("serial"):
        return SLURM_GROUP if "slurm" in item.path.name else SERIAL_GROUP
    if "mlflow_server" in getattr(item, "fixturenames", ()):
        return MLFLOW_GROUP
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups into the test ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        group = xdist_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture
def gsm8k_dir() -> Path:
    """The real GSM8K (MIT) beside the repo in ../shared, or where $VERL_PIPELINE_GSM8K_DIR points (a
    checkout elsewhere); skip when absent (a user's clone)."""
    for d in (GSM8K_DIR, Path(os.environ.get("VERL_PIPELINE_GSM8K_DIR", "/nonexistent"))):
        if (d / "train.jsonl").is_file():
            return d
    pytest.skip(f"GSM8K not found at {GSM8K_DIR} (or $VERL_PIPELINE_GSM8K_DIR)")


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    from verl_pipeline.models.prefetch import prefetch
    from verl_pipeline.spec import ModelSource

    return Path(prefetch(ModelSource("builtin", "tiny-qwen2"), _TMP / "shared-models").path)


@pytest.fixture(scope="session")
def airflow_db() -> Path:
    """A migrated metadata DB in the throwaway AIRFLOW_HOME."""
    home = Path(os.environ["AIRFLOW_HOME"])
    home.mkdir(parents=True, exist_ok=True)
    airflow = Path(sys.executable).parent / "airflow"
    subprocess.run([str(airflow), "db", "migrate"], check=True, capture_output=True, env=dict(os.environ))
    return home


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[object]:
    """One real local Ray head (loopback) shared by the tests that only need a cluster to talk to."""
    from verl_pipeline.cluster import procs
    from verl_pipeline.cluster.local import LocalBackend

    backend = LocalBackend.from_spec({"backend": "local", "num_cpus": 2, "stop_grace_s": 3})
    handle = backend.provision(f"pytest/shared-cluster-{os.getpid()}")
    yield handle
    backend.teardown(handle)
    assert procs.alive(procs.with_cmdline(handle.extra["temp_dir"])) == []


def ray_processes(temp_dir: str) -> list[int]:
    """PIDs of live processes that name ``temp_dir`` or belong to a Ray session under it."""
    from verl_pipeline.cluster import procs

    return [r.pid for r in procs.alive(procs.with_cmdline(temp_dir))]


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.fixture(scope="session")
def fsdp_checkpoint(tiny_model_path: Path) -> Path:
    """A real verl FSDP checkpoint of the tiny model, made once per session (~20 s): ``checkpoints/``
    holds ``global_step_2`` (world size 2, two AdamW steps from the tiny model, saved by verl's
    ``FSDPCheckpointManager``) and verl's tracker; ``full_state.pt`` is the full state dict the ranks
    trained. Copy it before changing anything (``shutil.copytree``)."""
    from tests.fakes.fsdp_checkpoint import FsdpJob, write_checkpoint

    root = _TMP / "fsdp-checkpoint"
    if not (root / "checkpoints" / "latest_checkpointed_iteration.txt").is_file():
        write_checkpoint(FsdpJob(model_path=str(tiny_model_path), step_dir=str(root / "checkpoints" / "global_step_2"),
                                 global_step=2, world_size=2, full_state_path=str(root / "full_state.pt")))
        (root / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("2")
    return root


@pytest.fixture(scope="session")
def lora_fsdp_checkpoint(tiny_model_path: Path) -> Path:
    """:func:`fsdp_checkpoint` of a LoRA actor (rank 8, alpha 16, every linear layer, as verl's FSDP engine wraps
    one with PEFT): ``checkpoints/global_step_2`` as verl's ``FSDPCheckpointManager`` saves it (with its
    ``lora_train_meta.json``), and ``full_state.pt`` the trained PEFT state dict (~20 s, once per session)."""
    from tests.fakes.fsdp_checkpoint import FsdpJob, write_checkpoint

    root = _TMP / "lora-fsdp-checkpoint"
    if not (root / "checkpoints" / "latest_checkpointed_iteration.txt").is_file():
        write_checkpoint(FsdpJob(model_path=str(tiny_model_path), step_dir=str(root / "checkpoints" / "global_step_2"),
                                 global_step=2, world_size=2, full_state_path=str(root / "full_state.pt"),
                                 lora_rank=8, lora_alpha=16))
        (root / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("2")
    return root


@pytest.fixture
def own_configs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the project's configs that the test may change ($VERL_PIPELINE_CONFIGS points at it)."""
    import shutil

    from verl_pipeline.paths import configs_dir

    cfg = tmp_path / "configs"
    shutil.copytree(configs_dir(), cfg)
    monkeypatch.setenv("VERL_PIPELINE_CONFIGS", str(cfg))
    return cfg


def write_pooled_cluster(configs: Path, pool: str, name: str = "shared") -> str:
    """``clusters/<name>.yaml``: the shipped gpu-address profile (8 GPUs) naming the Airflow pool ``pool``."""
    import yaml

    prof = yaml.safe_load((configs / "clusters" / "gpu-address.yaml").read_text())
    prof["cluster"]["pool"] = pool
    (configs / "clusters" / f"{name}.yaml").write_text(yaml.safe_dump(prof))
    return name


#: A cold ``mlflow server`` on a busy 2-core machine: ~30 s measured to healthy, more under load.
MLFLOW_START_S = 180.0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``mlflow server`` on a free loopback port, SQLite store, tmp artifact root; stopped by its process group.
    One per test session (per xdist worker): each test names its own experiments and models.

    gunicorn serves MLflow's Flask app (the default uvicorn app imports MLflow's whole FastAPI stack:
    68 s against 32 s to healthy here), with one worker and no job runner (MLflow's own background jobs).
    """
    import time

    import requests

    root = tmp_path_factory.mktemp("mlflow")
    port = _free_port()
    log_file = open(root / "server.log", "wb")
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--default-artifact-root", str(root / "artifacts"),
         "--workers", "1", "--gunicorn-opts", f"--timeout 60 --control-socket {root / 'gunicorn.ctl'}"],
        stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + MLFLOW_START_S
        while True:
            assert proc.poll() is None, f"mlflow server exited: {(root / 'server.log').read_text()[-2000:]}"
            try:
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert time.monotonic() < deadline, f"mlflow server not healthy after {MLFLOW_START_S}s"
            time.sleep(0.25)
        yield url
    finally:
        _stop_group(proc)
        log_file.close()


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's own process group (its session: the CLI, gunicorn's master and worker), then SIGKILL."""
    import signal
    import time

    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
