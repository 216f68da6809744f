"""Put each model of a run where every Ray node can read it and return its local path (what verl receives).

Sources: the built-in tiny model, ``hf://org/name@revision`` (:mod:`verl_pipeline.models.hub`),
local directories (verified in place) and fsspec URLs (copied into the cache). Every source ends
with a manifest written atomically after verification; a repeat run checks the manifest against
the files on disk (sizes, safetensors headers, no hashing) and returns at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from verl_pipeline.exceptions import ModelError
from verl_pipeline.models.cache import (
    ProgressLog,
    check_free_space,
    disk_full_error,
    ensure_writable,
    model_lock,
)
from verl_pipeline.models.hub import DEFAULT_ALLOW_PATTERNS, fetch_hub
from verl_pipeline.models.manifest import (
    FileEntry,
    Manifest,
    check_against_disk,
    list_files,
    manifest_path,
    read_manifest,
)
from verl_pipeline.models.tiny import TINY_MODEL_VERSION, build_tiny_model, config_facts
from verl_pipeline.paths import short_hash, slug
from verl_pipeline.spec import ModelSource, RunSpec
from verl_pipeline.trainer.modelfacts import check_prefetched, read_config
from verl_pipeline.trainer.verify import TOKENIZER_FILES, verify_model_dir

log = logging.getLogger(__name__)

# Kept importable from here (older callers).
_TOKENIZER_FILES = TOKENIZER_FILES


@dataclass
class PrefetchResult:
    source: str
    path: str
    revision: str | None
    files: int
    bytes: int
    seconds: float
    commit: str | None = None
    cached: bool = False
    manifest: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _result(source: ModelSource, path: Path, m: Manifest, cached: bool, t0: float, manifest_path: Path
            ) -> PrefetchResult:
    r = PrefetchResult(str(source), str(path), m.revision, len(m.files), m.total_bytes,
                       round(time.monotonic() - t0, 3), commit=m.commit, cached=cached,
                       manifest=str(manifest_path))
    log.info("Model %s %s at %s (%d files, %d bytes%s) in %.2fs", source,
             "verified in the cache" if cached else "fetched and verified", path, r.files, r.bytes,
             f", commit {m.commit}" if m.commit else "", r.seconds)
    return r


def _cached(manifest_path: Path, root: Path, what: str) -> Manifest | None:
    m = read_manifest(manifest_path)
    if m is None:
        return None
    try:
        check_against_disk(m, root)
    except ModelError as e:
        log.warning("Cached %s does not match its manifest (%s): verifying it again", what, e)
        return None
    return m


def _manifest_for(source: ModelSource, root: Path, *, revision: str | None, commit: str | None,
                  with_mtime: bool = False, remote: dict[str, Any] | None = None) -> Manifest:
    facts = verify_model_dir(root)
    files = {}
    for rel, p in sorted(list_files(root).items()):
        st = p.stat()
        files[rel] = FileEntry(size=st.st_size, mtime_ns=st.st_mtime_ns if with_mtime else None)
    return Manifest(source=str(source), kind=source.kind, path=str(root), revision=revision, commit=commit,
                    files=files, facts=facts, remote=dict(remote or {}))


# -- built-in ---------------------------------------------------------------------------------------
def _builtin(source: ModelSource, cache_root: Path) -> tuple[Path, Manifest, bool, Path]:
    dest = (cache_root / "builtin" / TINY_MODEL_VERSION).resolve()
    mpath = manifest_path(dest.parent, dest.name)
    hit = _cached(mpath, dest, str(source))
    if hit is not None:
        return dest, hit, True, mpath
    ensure_writable(cache_root)
    with model_lock(dest.parent / ".locks" / f"{dest.name}.lock", str(source)):
        hit = _cached(mpath, dest, str(source))
        if hit is not None:
            return dest, hit, True, mpath
        build_tiny_model(dest)
        m = _manifest_for(source, dest, revision=TINY_MODEL_VERSION, commit=TINY_MODEL_VERSION)
        m.write(mpath)
    return dest, m, False, mpath


# -- local directory ---------------------------------------------------------------------------------
def _local(source: ModelSource, cache_root: Path) -> tuple[Path, Manifest, bool, Path]:
    path = Path(source.ref)
    if not path.is_dir():
        raise ModelError(f"model directory {path} does not exist")
    # The directory may be read-only: its manifest lives in the cache, keyed by path, with mtimes.
    mpath = manifest_path(cache_root / "local", f"{slug(path.name, 40)}-{short_hash(str(path))}")
    hit = _cached(mpath, path, str(source))
    if hit is not None:
        return path, hit, True, mpath
    m = _manifest_for(source, path, revision=None, commit=None, with_mtime=True)
    try:
        m.write(mpath)
    except OSError as e:
        log.warning("Cannot record the verification of %s in %s (%s): it is verified again next time", path,
                    mpath, e)
    return path, m, False, mpath


# -- fsspec URLs --------------------------------------------------------------------------------------
def _remote_listing(url: str) -> tuple[Any, str, dict[str, dict[str, Any]]]:
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(url)
    except ImportError as e:
        raise ModelError(f"{url}: the fsspec backend for this URL is not installed ({e})") from None
    try:
        found = fs.find(root, detail=True, withdirs=False)
    except FileNotFoundError:
        raise ModelError(f"{url}: no such directory") from None
    base = root.rstrip("/")
    listing: dict[str, dict[str, Any]] = {}
    for name, info in found.items():
        rel = name[len(base):].lstrip("/") if name.startswith(base) else name.rsplit("/", 1)[-1]
        stamp = next((str(info[k]) for k in ("ETag", "etag", "md5Hash", "checksum", "mtime", "LastModified",
                                              "updated", "created") if info.get(k) is not None), "")
        listing[rel] = {"size": int(info.get("size") or 0), "stamp": stamp, "name": name}
    if not listing:
        raise ModelError(f"{url}: no files under this URL")
    return fs, root, listing


def _fsspec(source: ModelSource, cache_root: Path) -> tuple[Path, Manifest, bool, Path]:
    from huggingface_hub.utils import filter_repo_objects

    dest = cache_root / "fsspec" / f"{slug(source.ref.rsplit('/', 1)[-1], 40)}-{short_hash(source.ref)}"
    mpath = manifest_path(dest.parent, dest.name)
    try:
        fs, _root, listing = _remote_listing(source.ref)
    except (OSError, ModelError) as e:
        hit = _cached(mpath, dest, str(source))
        if hit is None:
            raise ModelError(f"{source}: cannot list the remote ({e}) and the model is not in the cache") from None
        log.warning("Cannot list %s (%s): using the cached copy from %s", source, e, time.ctime(hit.created_at))
        return dest, hit, True, mpath
    patterns = list(source.allow_patterns or DEFAULT_ALLOW_PATTERNS)
    wanted = sorted(filter_repo_objects(listing.keys(), allow_patterns=patterns))
    if not wanted:
        raise ModelError(f"{source}: no file matches the allow patterns {patterns}")
    remote = {rel: {"size": listing[rel]["size"], "stamp": listing[rel]["stamp"]} for rel in wanted}
    hit = _cached(mpath, dest, str(source))
    if hit is not None and hit.remote == remote:
        return dest, hit, True, mpath
    ensure_writable(cache_root)
    with model_lock(dest.parent / ".locks" / f"{dest.name}.lock", str(source)):
        hit = _cached(mpath, dest, str(source))
        if hit is not None and hit.remote == remote:
            return dest, hit, True, mpath
        previous = hit or read_manifest(mpath)
        old = previous.remote if previous is not None else {}
        todo = [rel for rel in wanted if not ((dest / rel).is_file() and old.get(rel) == remote[rel]
                                               and (dest / rel).stat().st_size == remote[rel]["size"])]
        need = sum(remote[rel]["size"] for rel in todo)
        check_free_space(dest, need, f"{source} ({len(todo)} files)")
        progress = ProgressLog(f"Copying {source}", need)
        try:
            for rel in todo:
                target = dest / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                part = target.with_name(f".{target.name}.partial")
                fs.get_file(listing[rel]["name"], str(part))
                part.replace(target)
                progress.add(remote[rel]["size"])
        except OSError as e:
            full = disk_full_error(e, dest, str(source))
            if full is not None:
                raise full from None
            raise ModelError(f"{source}: copy failed at {rel}: {e}; rerun to resume (copied files are kept)") from None
        progress.finish()
        mpath.unlink(missing_ok=True)
        m = _manifest_for(source, dest, revision=None, commit=None, remote=remote)
        m.files = {rel: m.files[rel] for rel in wanted}
        m.write(mpath)
    return dest, m, False, mpath


# -- entry points --------------------------------------------------------------------------------------
def prefetch(source: ModelSource, cache_root: Path, *, token: str | None = None,
             verify_hashes: bool = True) -> PrefetchResult:
    """Fetch (or build) ``source`` into ``cache_root``, verify it, return its local path. Idempotent.

    ``token`` (hub sources) is never logged.
    """
    t0 = time.monotonic()
    cache_root = Path(cache_root).expanduser().resolve()
    if source.kind == "builtin":
        path, m, cached, mpath = _builtin(source, cache_root)
    elif source.kind == "hf":
        path, m, cached = fetch_hub(source, cache_root, token=token, verify_hashes=verify_hashes)
        mpath = manifest_path(path.parent, path.name)
    elif source.kind == "fsspec":
        path, m, cached, mpath = _fsspec(source, cache_root)
    else:
        path, m, cached, mpath = _local(source, cache_root)
    return _result(source, path, m, cached, t0, mpath)


def plan_models(spec: RunSpec) -> list[dict[str, Any]]:
    """The run's distinct models, each with the roles it plays: what the DAG maps the prefetch over.

    ``[{"source": "builtin:tiny-qwen2", "roles": ["actor", "critic"]}, ...]`` (actor first).
    """
    plan: dict[ModelSource, list[str]] = {}
    for role, source in spec.model_sources().items():
        plan.setdefault(source, []).append(role)
    return [{"source": str(s), "roles": roles} for s, roles in plan.items()]


def prefetch_roles(spec: RunSpec, roles: Iterable[str], *, token: str | None = None,
                   cache_root: Path | None = None) -> dict[str, dict[str, Any]]:
    """Prefetch the model playing ``roles`` in ``spec`` once; the result keyed by each role."""
    roles = list(roles)
    sources = spec.model_sources()
    unknown = [r for r in roles if r not in sources]
    if not roles or unknown:
        raise ModelError(f"run {spec.run_name} has no model for role(s) {unknown or roles} "
                         f"(it has {sorted(sources)})")
    distinct = {sources[r] for r in roles}
    if len(distinct) != 1:
        raise ModelError(f"roles {roles} name different models: {sorted(str(s) for s in distinct)}")
    result = prefetch(sources[roles[0]], cache_root or spec.model_cache, token=token).to_dict()
    if "actor" in roles:
        check_actor_facts(spec, Path(result["path"]))
    return {role: {**result, "role": role} for role in roles}


def check_actor_facts(spec: RunSpec, model_dir: Path) -> None:
    """The run's model facts against the prefetched actor's own config.json (``trainer/modelfacts.py``): a
    contradiction is a ConfigError naming both values, before anything is submitted; a fact the run's rules
    had to assume is logged with the value the config gives."""
    config = read_config(model_dir)
    if spec.model_facts is None or config is None:
        return
    for note in check_prefetched(spec.model_facts, config, profile=spec.model_profile):
        log.warning("Run %s: %s", spec.run_name, note)


def config_on_this_machine(source: ModelSource) -> tuple[dict[str, Any], str] | None:
    """The model's config.json where this machine has the model without a download (what ``build_run_spec``
    checks the model profile against at provision): a local directory's, or the built-in model's (its
    architecture as :func:`~verl_pipeline.models.tiny.build_tiny_model` writes it; nothing is built); None for
    the other sources."""
    if source.kind == "builtin":
        return config_facts(), f"config.json of {source} ({TINY_MODEL_VERSION})"
    return read_config(source.ref) if source.kind == "path" else None


def prefetch_run(spec: RunSpec, *, token: str | None = None, cache_root: Path | None = None
                 ) -> dict[str, dict[str, Any]]:
    """Every model of the run (distinct ones once), keyed by role."""
    out: dict[str, dict[str, Any]] = {}
    for item in plan_models(spec):
        out.update(prefetch_roles(spec, item["roles"], token=token, cache_root=cache_root))
    return out


def models_by_role(pulled: Any) -> dict[str, dict[str, Any]]:
    """Merge the prefetch task's XCom (one ``{role: result}`` dict per mapped instance) into one dict.

    Airflow returns a single value when one instance ran and a list when several did.
    """
    items = [pulled] if pulled is None or isinstance(pulled, dict) else list(pulled)
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        if not item:
            continue
        if not isinstance(item, dict):
            raise ModelError(f"unexpected prefetch result {type(item).__name__}: expected a dict by role")
        out.update(item)
    return out


__all__ = ["PrefetchResult", "check_actor_facts", "config_on_this_machine", "models_by_role",
           "plan_models", "prefetch", "prefetch_roles", "prefetch_run",
           "verify_model_dir"]
