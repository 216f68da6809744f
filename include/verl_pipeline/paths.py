"""Filesystem helpers: the pipeline's home directory, atomic writes, content hashing, free space."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from verl_pipeline.exceptions import ConfigError

#: Repository root when the package is installed editable from a checkout (``include/verl_pipeline``).
_PACKAGE_DIR = Path(__file__).resolve().parent


def package_dir() -> Path:
    """Directory of this package (what ``py_modules`` ships to a Ray cluster)."""
    return _PACKAGE_DIR


def pipeline_home() -> Path:
    """Root for the pipeline's state, data, model cache and checkpoints on this machine.

    ``$VERL_PIPELINE_HOME`` when set, else ``~/.cache/verl-pipeline``.
    """
    env = os.environ.get("VERL_PIPELINE_HOME")
    home = Path(env).expanduser() if env else Path.home() / ".cache" / "verl-pipeline"
    return home.resolve()


def configs_dir() -> Path:
    """Directory holding the YAML profiles.

    ``$VERL_PIPELINE_CONFIGS`` when set, else ``configs/`` of the checkout the package was
    installed from.
    """
    env = os.environ.get("VERL_PIPELINE_CONFIGS")
    if env:
        return Path(env).expanduser().resolve()
    return _PACKAGE_DIR.parent.parent / "configs"


def slug(text: str, max_len: int = 40) -> str:
    """A lowercase ``[a-z0-9-]`` version of ``text``, for ids and directory names."""
    s = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return s[:max_len].strip("-") or "x"


def short_hash(*parts: object, length: int = 10) -> str:
    """A stable hex digest of ``parts`` (joined with NUL)."""
    h = hashlib.sha256("\0".join(str(p) for p in parts).encode())
    return h.hexdigest()[:length]


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes (hex), read in 8 MiB chunks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


@contextmanager
def atomic_path(dest: Path) -> Iterator[Path]:
    """Yield a temporary path next to ``dest``; on success it is renamed over ``dest``.

    Readers never see a half-written file, and a crash leaves ``dest`` untouched.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.replace(tmp_path, dest)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def write_json_atomic(dest: Path, data: Any) -> None:
    """Write ``data`` as indented JSON to ``dest`` atomically."""
    with atomic_path(dest) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


#: fsspec protocol → the pip package that implements it (for the missing-backend error).
FSSPEC_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs",
                   "abfss": "adlfs", "hdfs": "pyarrow", "http": "aiohttp", "https": "aiohttp", "sftp": "paramiko",
                   "ssh": "paramiko", "hf": "huggingface_hub", "oci": "ocifs", "oss": "ossfs"}


def fsspec_filesystem(url: str) -> tuple[Any, str]:
    """``(filesystem, path)`` for ``url``; a missing backend raises a ConfigError naming the pip package."""
    import fsspec

    protocol = url.split("://", 1)[0].lower()
    hdfs_fix = ("set JAVA_HOME and HADOOP_HOME (pyarrow's libhdfs needs Java and Hadoop's client), "
                "or copy the data to shared storage and pass its path")
    if protocol in ("hdfs", "viewfs") and not os.environ.get("JAVA_HOME"):
        raise ConfigError("data_source", url, f"{protocol}:// needs a Java runtime and JAVA_HOME is not set",
                          hdfs_fix)
    try:
        fs, path = fsspec.core.url_to_fs(url)
    except OSError as e:  # the backend is installed but cannot start here (a missing JVM, client library …)
        fix = hdfs_fix if protocol in ("hdfs", "viewfs") else f"configure the {protocol}:// client on this host"
        raise ConfigError("data_source", url, f"the {protocol}:// filesystem cannot be opened here ({e})",
                          fix) from None
    except ImportError as e:
        package = FSSPEC_PACKAGES.get(protocol, f"the fsspec backend for {protocol}://")
        raise ConfigError("data_source", url, f"no fsspec backend for {protocol}:// is installed ({e})",
                          f"pip install {package}") from None
    except ValueError as e:
        raise ConfigError("data_source", url, f"unknown URL protocol {protocol}:// ({e})",
                          "a local path, s3://, gs://, file://, memory:// … (fsspec)") from None
    return fs, path


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem holding ``path`` (or its nearest existing parent)."""
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free
