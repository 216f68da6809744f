"""The hub path end to end against a local server that answers like the hub (tests/models/hub_server.py).

Real huggingface_hub client, real HTTP, real files; only the hub itself is stood in for.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.models.hub_server import FakeHub, Repo
from verl_pipeline.exceptions import ModelError
from verl_pipeline.models.hub import ModelAccessError
from verl_pipeline.models.prefetch import prefetch
from verl_pipeline.spec import ModelSource

TOKEN = "hf_test_secret_token_do_not_log_123"


@pytest.fixture
def hub(tiny_model_path: Path) -> Iterator[FakeHub]:
    with FakeHub() as h:
        h.repos["acme/tiny"] = Repo.from_dir(tiny_model_path)
        h.repos["acme/gated"] = Repo.from_dir(tiny_model_path, token=TOKEN)
        yield h


@pytest.fixture
def online(hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> FakeHub:
    """Point huggingface_hub at the local server (the suite runs with HF_HUB_OFFLINE=1)."""
    import huggingface_hub.constants as c

    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(c, "HF_HUB_DISABLE_XET", True)
    return hub


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_fetch_pins_the_commit_writes_a_manifest_and_logs_progress(
    online: FakeHub, tmp_path: Path, tiny_model_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    repo = online.repos["acme/tiny"]
    r = prefetch(ModelSource.parse("hf://acme/tiny@main"), tmp_path)
    path = Path(r.path)
    assert path == tmp_path.resolve() / "hf" / "acme--tiny" / repo.commit
    assert r.commit == repo.commit and r.revision == "main" and not r.cached
    for name, data in repo.files.items():
        assert (path / name).read_bytes() == data
    manifest = json.loads(Path(r.manifest or "").read_text())
    assert manifest["commit"] == repo.commit
    assert manifest["files"]["model.safetensors"]["sha256"] == _sha(tiny_model_path / "model.safetensors")
    assert manifest["files"]["config.json"]["size"] == len(repo.files["config.json"])
    assert (tmp_path / "hf" / "acme--tiny" / "refs" / "main").read_text() == repo.commit
    assert any("(100.0%)" in m and "Downloading hf://acme/tiny@main" in m for m in caplog.messages)


def test_repeat_run_is_a_fast_cache_hit_without_downloads(online: FakeHub, tmp_path: Path) -> None:
    repo = online.repos["acme/tiny"]
    prefetch(ModelSource.parse("hf://acme/tiny@main"), tmp_path)
    online.requests.clear()
    again = prefetch(ModelSource.parse("hf://acme/tiny@main"), tmp_path)
    assert again.cached and again.seconds < 10
    # A branch costs one revision lookup, nothing else.
    assert [r.path for r in online.requests] == ["/api/models/acme/tiny/revision/main"]
    online.requests.clear()
    pinned = prefetch(ModelSource.parse(f"hf://acme/tiny@{repo.commit}"), tmp_path)
    assert pinned.cached and pinned.path == again.path and online.requests == []


def test_a_damaged_cache_is_fetched_again(online: FakeHub, tmp_path: Path) -> None:
    r = prefetch(ModelSource.parse("hf://acme/tiny@main"), tmp_path)
    weights = Path(r.path) / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[: len(good) // 2])
    again = prefetch(ModelSource.parse("hf://acme/tiny@main"), tmp_path)
    assert not again.cached and weights.read_bytes() == good


def test_interrupted_transfer_resumes_with_a_range_request(online: FakeHub, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants as c

    # The client writes in DOWNLOAD_CHUNK_SIZE pieces (10 MB) and resumes after the last whole one;
    # scaled down here to the tiny model's 0.5 MB.
    monkeypatch.setattr(c, "DOWNLOAD_CHUNK_SIZE", 50_000)
    size = len(online.repos["acme/tiny"].files["model.safetensors"])
    cut = 200_000
    online.cut["model.safetensors"] = [cut, 1]
    r = prefetch(ModelSource.parse("hf://acme/tiny@main"), tmp_path)
    gets = online.gets("model.safetensors")
    assert len(gets) == 2, gets
    assert gets[0].range is None and gets[1].range == f"bytes={cut}-"
    assert (Path(r.path) / "model.safetensors").stat().st_size == size


def test_gated_model_needs_a_token_and_never_logs_it(
    online: FakeHub, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    with pytest.raises(ModelError, match=r"gated or private and no token was given.*hf_default") as e:
        prefetch(ModelSource.parse("hf://acme/gated@main"), tmp_path)
    assert TOKEN not in str(e.value) and isinstance(e.value, ModelAccessError)  # no point retrying
    with pytest.raises(ModelError, match="token has no access"):
        prefetch(ModelSource.parse("hf://acme/gated@main"), tmp_path, token="hf_wrong")
    r = prefetch(ModelSource.parse("hf://acme/gated@main"), tmp_path, token=TOKEN)
    assert (Path(r.path) / "config.json").is_file()
    assert all(req.authorized for req in online.requests if "gated" in req.path and "/resolve/" in req.path)
    assert TOKEN not in caplog.text


def test_unknown_repo_and_revision(online: FakeHub, tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="no such repository on the hub"):
        prefetch(ModelSource.parse("hf://acme/missing@main"), tmp_path)
    with pytest.raises(ModelError, match="revision 'v9' does not exist in acme/tiny"):
        prefetch(ModelSource.parse("hf://acme/tiny@v9"), tmp_path)
    with pytest.raises(ModelError, match="no such repository"):
        prefetch(ModelSource.parse(f"hf://acme/missing@{'a' * 40}"), tmp_path)


def test_unreachable_hub_uses_the_cache_or_says_what_is_missing(
    online: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = prefetch(ModelSource.parse("hf://acme/tiny@main"), tmp_path)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    again = prefetch(ModelSource.parse("hf://acme/tiny@main"), tmp_path)
    assert again.cached and again.path == first.path and again.commit == first.commit
    with pytest.raises(ModelError, match="unreachable and the model is not in the cache"):
        prefetch(ModelSource.parse("hf://acme/tiny@main"), tmp_path / "empty")


def test_hub_outage_falls_back_to_the_last_seen_commit(online: FakeHub, tmp_path: Path) -> None:
    first = prefetch(ModelSource.parse("hf://acme/tiny@main"), tmp_path)
    online.api_status = 503
    again = prefetch(ModelSource.parse("hf://acme/tiny@main"), tmp_path)
    assert again.cached and again.commit == first.commit
    with pytest.raises(ModelError, match="the hub answered HTTP 503; retry later") as e:
        prefetch(ModelSource.parse("hf://acme/tiny@main"), tmp_path / "empty")
    assert not isinstance(e.value, ModelAccessError)


def test_disk_full_is_reported_before_downloading(
    online: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    from verl_pipeline import paths

    real = shutil.disk_usage
    # The one thing this machine cannot provide on demand: a nearly full disk.
    monkeypatch.setattr(paths.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    with pytest.raises(ModelError, match=r"disk full: hf://acme/tiny@main \(\d+ files\) needs .* only 1000 B"):
        prefetch(ModelSource.parse("hf://acme/tiny@main"), tmp_path)
    assert online.gets("model.safetensors") == []


def test_disk_full_during_a_transfer_names_the_cause() -> None:
    import errno

    from verl_pipeline.models.cache import disk_full_error

    err = disk_full_error(OSError(errno.ENOSPC, "No space left on device"), Path("/c"), "hf://a/b@main")
    assert err is not None and "disk full while fetching hf://a/b@main into /c" in str(err)
    assert disk_full_error(OSError(errno.EIO, "I/O error"), Path("/c"), "x") is None


def test_cache_root_not_writable(online: FakeHub, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ModelError, match=r"model cache root .*a-file/cache is not writable.*storage\.root"):
        prefetch(ModelSource.parse("hf://acme/tiny@main"), blocker / "cache")
    if os.geteuid() != 0:  # root ignores permission bits
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(ModelError, match="is not writable"):
            prefetch(ModelSource.parse("hf://acme/tiny@main"), ro)


def test_custom_allow_patterns(online: FakeHub, tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="no file of the repository matches"):
        prefetch(ModelSource.parse("hf://acme/tiny@main", allow_patterns=["*.gguf"]), tmp_path)
    with pytest.raises(ModelError, match="has no weights"):
        prefetch(ModelSource.parse("hf://acme/tiny@main", allow_patterns=["*.json"]), tmp_path)


@pytest.mark.integration
def test_two_concurrent_prefetches_download_once(hub: FakeHub, tmp_path: Path) -> None:
    """Two CLI processes fetch the same model at once: one downloads, the other waits on the lock."""
    hub.delay_per_chunk = 1.0  # ~8 s for the weights
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_XET": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2] / "include"),
                                          os.environ.get("PYTHONPATH", "")])}
    env.pop("HF_TOKEN", None)
    cmd = [sys.executable, "-m", "verl_pipeline", "prefetch", "--model", "hf://acme/tiny@main",
           "--cache", str(tmp_path), "--json"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)]
    # The second starts once the first is transferring the weights, so it arrives mid-download.
    deadline = time.monotonic() + 120
    while not hub.gets("model.safetensors") and time.monotonic() < deadline and procs[0].poll() is None:
        time.sleep(0.05)
    assert hub.gets("model.safetensors"), "the first prefetch never started downloading"
    procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))

    def lookups() -> int:
        return sum(r.path == "/api/models/acme/tiny/revision/main" for r in list(hub.requests))

    while lookups() < 2 and time.monotonic() < deadline and procs[1].poll() is None:
        time.sleep(0.05)
    assert lookups() == 2 and procs[0].poll() is None, "the second prefetch did not overlap the first"
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
        outs.append(json.loads(out)["actor"])
    assert outs[0]["path"] == outs[1]["path"]
    assert [o["cached"] for o in outs] == [False, True]
    assert procs[1].returncode == 0
    assert len(hub.gets("model.safetensors")) == 1
    data = hub.repos["acme/tiny"].files["model.safetensors"]
    assert (Path(outs[0]["path"]) / "model.safetensors").read_bytes() == data


def test_offline_mode_with_a_pinned_cached_commit_needs_no_network(online: FakeHub, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants as c

    prefetch(ModelSource.parse("hf://acme/tiny@main"), tmp_path)
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    online.requests.clear()
    t0 = time.monotonic()
    r = prefetch(ModelSource.parse("hf://acme/tiny@main"), tmp_path)
    assert r.cached and online.requests == [] and time.monotonic() - t0 < 10
