"""Put a model where the job can read it and return its local path (what verl receives)."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from verl_pipeline.config import ModelSource
from verl_pipeline.exceptions import ModelError
from verl_pipeline.models.tiny import TINY_MODEL_VERSION, build_tiny_model

log = logging.getLogger(__name__)

#: Weights, configs and tokenizer files; skips other formats (.bin/.pth/.gguf duplicates, images).
DEFAULT_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.py", "*.tiktoken"]
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")


@dataclass
class PrefetchResult:
    source: str
    path: str
    revision: str | None
    files: int
    bytes: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def verify_model_dir(path: Path) -> None:
    """A model directory verl can load: config.json and a tokenizer are present."""
    if not (path / "config.json").is_file():
        raise ModelError(f"model directory {path} has no config.json")
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        raise ModelError(f"model directory {path} has no tokenizer file (one of {', '.join(_TOKENIZER_FILES)})")


def _hub(source: ModelSource, cache_root: Path, token: str | None) -> tuple[Path, str | None]:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        path = snapshot_download(
            repo_id=source.ref, revision=source.revision, cache_dir=str(cache_root / "hf"),
            allow_patterns=DEFAULT_ALLOW_PATTERNS, token=token,
        )
    except GatedRepoError as e:
        raise ModelError(f"{source} is gated or private: set a token with access (Airflow connection "
                         f"hf_default password or HF_TOKEN) ({e.__class__.__name__})") from None
    except RevisionNotFoundError:
        raise ModelError(f"{source}: revision {source.revision!r} does not exist") from None
    except RepositoryNotFoundError:
        raise ModelError(f"{source}: no such repository on the hub (or it is private and no token was given)") from None
    except LocalEntryNotFoundError:
        raise ModelError(
            f"{source}: the hub is unreachable and the model is not in the cache {cache_root / 'hf'}; "
            "prefetch it on a machine with access or point model_source at a local directory"
        ) from None
    return Path(path), source.revision


def prefetch(source: ModelSource, cache_root: Path, *, token: str | None = None) -> PrefetchResult:
    """Fetch (or build) ``source`` into ``cache_root`` and verify it. Idempotent."""
    t0 = time.monotonic()
    if source.kind == "builtin":
        path = build_tiny_model(cache_root / "builtin" / TINY_MODEL_VERSION)
        revision: str | None = TINY_MODEL_VERSION
    elif source.kind == "hf":
        path, revision = _hub(source, cache_root, token)
    else:
        path, revision = Path(source.ref), None
        if not path.is_dir():
            raise ModelError(f"model directory {path} does not exist")
    verify_model_dir(path)
    files = [p for p in path.rglob("*") if p.is_file()]
    result = PrefetchResult(str(source), str(path), revision, len(files), sum(p.stat().st_size for p in files),
                            round(time.monotonic() - t0, 3))
    log.info("Model %s ready at %s (%d files, %d bytes) in %.2fs", source, path, result.files, result.bytes,
             result.seconds)
    return result
