"""``hf://org/name@revision`` into the shared cache, pinned to a commit, verified, once.

Layout under the cache root::

    hf/<org>--<name>/<commit>/                 the model files (what the job receives)
    hf/<org>--<name>/<commit>.manifest.json    written last, atomically: the directory is complete
    hf/<org>--<name>/refs/<revision>           branch/tag -> commit last seen (offline fallback)
    hf/<org>--<name>/.locks/<commit>.lock      one prefetch of a commit at a time

A commit revision with a manifest needs no network at all. A branch or tag costs one API call to
learn its commit (or, when the hub is unreachable, the commit recorded in ``refs/``).

Transfers use ``huggingface_hub.snapshot_download`` into the commit directory (``local_dir``):
a connection dropped mid-file is resumed with an HTTP Range request from the bytes already
received, and a rerun after a crash keeps every file that completed (only unfinished files are
fetched again).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from pathlib import Path
from typing import Any

from verl_pipeline.exceptions import ModelError
from verl_pipeline.models.cache import ProgressLog, check_free_space, disk_full_error, ensure_writable, model_lock
from verl_pipeline.models.manifest import FileEntry, Manifest, check_against_disk, manifest_path, read_manifest
from verl_pipeline.paths import file_sha256
from verl_pipeline.spec import ModelSource
from verl_pipeline.trainer.verify import verify_model_dir

log = logging.getLogger(__name__)

#: Weights, configs and tokenizer files; skips other formats (.bin/.pth/.gguf duplicates, images).
DEFAULT_ALLOW_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.py", "*.tiktoken")

_COMMIT = re.compile(r"^[0-9a-f]{40}$")
#: Seconds for the API calls (revision lookup, file listing); downloads have their own retries.
API_TIMEOUT_S = 20.0
_TOKEN_HINT = "set the Airflow connection hf_default (password = a hub token with access) or HF_TOKEN"


class ModelAccessError(ModelError):
    """The model cannot be fetched as asked (gated, no such repository or revision): retrying will not help."""


def repo_dir(cache_root: Path, repo: str) -> Path:
    return cache_root / "hf" / repo.replace("/", "--")


def _offline() -> bool:
    import huggingface_hub.constants as c

    return bool(c.HF_HUB_OFFLINE)


def _endpoint() -> str | None:
    """Read at call time (huggingface_hub reads HF_ENDPOINT once, at import)."""
    return os.environ.get("HF_ENDPOINT") or None


def _network_errors() -> tuple[type[BaseException], ...]:
    import httpx
    from huggingface_hub.errors import OfflineModeIsEnabled

    return (httpx.TransportError, OfflineModeIsEnabled, ConnectionError, TimeoutError)


def hub_error(source: ModelSource, e: BaseException, token: str | None) -> ModelError | None:
    """The user-facing error for a hub failure (never containing the token), or None if not a hub error."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(e, GatedRepoError):
        if token:
            return ModelAccessError(f"{source} is gated and the token has no access to it: accept the model's terms on "
                              "its hub page with the token's account, or use a token that has access")
        return ModelAccessError(f"{source} is gated or private and no token was given: {_TOKEN_HINT}")
    if isinstance(e, RevisionNotFoundError):
        return ModelAccessError(f"{source}: revision {source.revision!r} does not exist in {source.ref} "
                          "(use a branch, tag or commit hash listed on the model page)")
    if isinstance(e, RepositoryNotFoundError):
        hint = "check the name" if token else f"check the name, or if it is private {_TOKEN_HINT}"
        return ModelAccessError(f"{source}: no such repository on the hub ({hint})")
    if isinstance(e, RemoteEntryNotFoundError):
        return ModelError(f"{source}: a file listed by the hub is missing on it ({e.__class__.__name__})")
    if isinstance(e, HfHubHTTPError):
        status = e.response.status_code if e.response is not None else "?"
        return ModelError(f"{source}: the hub answered HTTP {status}; retry later")
    if isinstance(e, _network_errors()):
        return None
    return None


def _unreachable(source: ModelSource, cache: Path, e: BaseException | None) -> ModelError:
    why = e.__class__.__name__ if e else "HF_HUB_OFFLINE is set"
    return ModelError(
        f"{source}: the hub is unreachable and the model is not in the cache {cache} ({why}); prefetch it on a "
        "machine with access, point model_source at a local directory, or check HF_ENDPOINT/proxy settings"
    )


def _api(token: str | None) -> Any:
    from huggingface_hub import HfApi

    return HfApi(endpoint=_endpoint(), token=token)


def resolve_commit(source: ModelSource, cache_root: Path, token: str | None) -> str:
    """The commit ``source.revision`` names: itself for a hash, else from the hub (or the last seen ref)."""
    rev = source.revision or "main"
    if _COMMIT.match(rev):
        return rev
    ref_file = repo_dir(cache_root, source.ref) / "refs" / rev
    cached = ref_file.read_text().strip() if ref_file.is_file() else None
    if _offline():
        if cached:
            log.warning("HF_HUB_OFFLINE: using commit %s last seen for %s", cached, source)
            return cached
        raise _unreachable(source, repo_dir(cache_root, source.ref), None)
    try:
        info = _api(token).model_info(source.ref, revision=rev, timeout=API_TIMEOUT_S)
    except _network_errors() as e:
        if cached:
            log.warning("The hub is unreachable (%s): using commit %s last seen for %s", e.__class__.__name__,
                        cached, source)
            return cached
        raise _unreachable(source, repo_dir(cache_root, source.ref), e) from None
    except Exception as e:
        err = hub_error(source, e, token)
        if err is None:
            raise
        if cached and not isinstance(err, ModelAccessError):
            log.warning("The hub failed (%s): using commit %s last seen for %s", err, cached, source)
            return cached
        raise err from None
    if not info.sha or not _COMMIT.match(info.sha):
        raise ModelError(f"{source}: the hub returned no commit for revision {rev!r}")
    return str(info.sha)


def _write_ref(rdir: Path, rev: str, commit: str) -> None:
    from verl_pipeline.paths import atomic_path

    if rev == commit:
        return
    with atomic_path(rdir / "refs" / rev) as tmp:
        tmp.write_text(commit)


def cached_hub_model(source: ModelSource, cache_root: Path, commit: str) -> Manifest | None:
    """The manifest when ``commit`` is fully in the cache and its files still match it, else None."""
    rdir = repo_dir(cache_root, source.ref)
    m = read_manifest(manifest_path(rdir, commit))
    if m is None:
        return None
    try:
        check_against_disk(m, rdir / commit)
    except ModelError as e:
        log.warning("Cached %s does not match its manifest (%s): fetching it again", source, e)
        return None
    return m


def _progress_class(progress: ProgressLog) -> type:
    """A tqdm stand-in for snapshot_download whose byte counter feeds ``progress`` (the task log)."""
    lock = threading.Lock()

    class _LogBar:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.n = int(kwargs.get("initial") or 0)
            self.total = kwargs.get("total")
            self.desc = str(kwargs.get("desc") or "")
            self.format_dict: dict[str, Any] = {"rate": None}

        def __enter__(self) -> _LogBar:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def update(self, n: float | None = 1) -> None:
            step = int(n or 0)
            self.n += step
            if self.desc.startswith("Downloading bytes"):
                with lock:
                    progress.add(step)

        def refresh(self, *args: Any, **kwargs: Any) -> None:
            return None

        def close(self) -> None:
            return None

        def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
            return None

        def set_description_str(self, desc: str | None = None, refresh: bool = True) -> None:
            return None

        def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
            return None

    return _LogBar


def _size(entry: Any) -> int:
    lfs = entry.lfs
    return int(lfs.size if lfs is not None else entry.size)


def fetch_hub(source: ModelSource, cache_root: Path, *, token: str | None = None,
              verify_hashes: bool = True) -> tuple[Path, Manifest, bool]:
    """Fetch ``source`` into the cache (or find it there). Returns (model dir, manifest, was cached)."""
    commit = resolve_commit(source, cache_root, token)
    rdir = repo_dir(cache_root, source.ref)
    dest = rdir / commit
    hit = cached_hub_model(source, cache_root, commit)
    if hit is not None:
        return dest, hit, True
    if _offline():
        raise _unreachable(source, rdir, None)
    ensure_writable(cache_root)
    with model_lock(rdir / ".locks" / f"{commit}.lock", str(source)):
        hit = cached_hub_model(source, cache_root, commit)
        if hit is not None:  # another run finished it while we waited
            return dest, hit, True
        manifest = _download(source, commit, dest, token=token, verify_hashes=verify_hashes)
        manifest.write(manifest_path(rdir, commit))
        _write_ref(rdir, source.revision or "main", commit)
    return dest, manifest, False


def _download(source: ModelSource, commit: str, dest: Path, *, token: str | None,
              verify_hashes: bool) -> Manifest:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    from huggingface_hub.hf_api import RepoFile
    from huggingface_hub.utils import filter_repo_objects

    patterns = list(source.allow_patterns or DEFAULT_ALLOW_PATTERNS)
    try:
        tree = {f.path: f for f in _api(token).list_repo_tree(source.ref, revision=commit, recursive=True)
                if isinstance(f, RepoFile)}
    except _network_errors() as e:
        raise _unreachable(source, dest.parent, e) from None
    except Exception as e:
        err = hub_error(source, e, token)
        if err is None:
            raise
        raise err from None
    wanted = sorted(filter_repo_objects(tree.keys(), allow_patterns=patterns))
    if not wanted:
        raise ModelError(f"{source}: no file of the repository matches the allow patterns {patterns} "
                         f"(it has: {', '.join(sorted(tree)[:10])})")
    sizes = {p: _size(tree[p]) for p in wanted}
    for p in wanted:
        f = dest / p
        if f.is_file() and f.stat().st_size != sizes[p]:
            # snapshot_download trusts a file whose recorded etag matches: a damaged one must go first.
            log.warning("%s has %d bytes, the hub lists %d: fetching it again", f, f.stat().st_size, sizes[p])
            f.unlink()
    total = sum(sizes.values())
    have = sum(sizes[p] for p in wanted if (dest / p).is_file() and (dest / p).stat().st_size == sizes[p])
    check_free_space(dest, total - have, f"{source} ({len(wanted)} files)")
    progress = ProgressLog(f"Downloading {source} @ {commit[:12]}", total - have)
    log.info("Fetching %s (commit %s): %d files, %d bytes (%d already here) into %s", source, commit, len(wanted),
             total, have, dest)
    try:
        snapshot_download(
            repo_id=source.ref, revision=commit, local_dir=str(dest), allow_patterns=patterns, token=token,
            endpoint=_endpoint(), tqdm_class=_progress_class(progress),
            max_workers=4,
        )
    except OSError as e:
        full = disk_full_error(e, dest, str(source))
        if full is not None:
            raise full from None
        err = hub_error(source, e, token)
        if err is not None:
            raise err from None
        if isinstance(e, (*_network_errors(), LocalEntryNotFoundError)):
            raise ModelError(f"{source}: the download was interrupted ({e.__class__.__name__}) and did not "
                             "recover; rerun to resume (completed files are kept)") from None
        raise ModelError(f"{source}: download failed: {e.__class__.__name__}: {e}") from None
    except Exception as e:
        err = hub_error(source, e, token)
        if err is None:
            if isinstance(e, _network_errors()):
                raise ModelError(f"{source}: the download was interrupted ({e.__class__.__name__}) and did not "
                                 "recover; rerun to resume (completed files are kept)") from None
            raise
        raise err from None
    progress.finish()

    files: dict[str, FileEntry] = {}
    for p in wanted:
        path = dest / p
        size = path.stat().st_size if path.is_file() else -1
        if size != sizes[p]:
            raise ModelError(f"{path}: {size} bytes after download, the hub lists {sizes[p]}")
        entry = tree[p]
        sha = entry.lfs.sha256 if entry.lfs else None
        if verify_hashes and sha and file_sha256(path) != sha:
            path.unlink()
            raise ModelError(f"{path}: sha256 differs from the hub's {sha} (corrupted transfer); removed it, "
                             "rerun to fetch it again")
        files[p] = FileEntry(size=sizes[p], sha256=sha, blob_id=entry.blob_id)
    facts = verify_model_dir(dest)
    return Manifest(source=str(source), kind="hf", path=str(dest), revision=source.revision, commit=commit,
                    files=files, facts=facts)


__all__ = ["DEFAULT_ALLOW_PATTERNS", "ModelAccessError", "cached_hub_model", "fetch_hub", "hub_error", "repo_dir",
           "resolve_commit"]
