"""Ray token auth for the clusters the pipeline starts, and what it refuses to talk to.

Ray (>= 2.52) reads ``RAY_AUTH_MODE`` and then its token from, in order: ``RAY_AUTH_TOKEN`` (the
value), ``RAY_AUTH_TOKEN_PATH`` (a file), ``~/.ray/auth_token``. The pipeline gives every cluster
it starts a fresh token in a file only its user can read, and points Ray at it with
``RAY_AUTH_TOKEN_PATH``: a path, not the value, so the token is in no process environment, no
``runtime_env`` (readable through the Jobs API), no XCom and no log.
"""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
import stat
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from verl_pipeline.constants import AuthMode
from verl_pipeline.exceptions import ClusterError, ConfigError
from verl_pipeline.paths import atomic_path

#: The token file's name in the cluster's private state directory.
TOKEN_FILE = "ray_auth_token"
#: Ray's own environment variables for its auth mode and token sources.
MODE_VAR = "RAY_AUTH_MODE"
TOKEN_VAR = "RAY_AUTH_TOKEN"
TOKEN_PATH_VAR = "RAY_AUTH_TOKEN_PATH"
#: What every variable of Ray's auth starts with (the three above): a backend sets them, a profile never does.
AUTH_VAR_PREFIX = "RAY_AUTH_"
#: The pipeline's own fallback for the token of a cluster it did not start (``address``), when no
#: Airflow connection gives one.
PIPELINE_TOKEN_VAR = "VERL_PIPELINE_RAY_TOKEN"
#: What an open Jobs API lets anyone who reaches its port do (named in every refusal).
SHADOWRAY = ("anyone who can reach this port can run code on the cluster as its user "
             "(ShadowRay, CVE-2023-48022)")


def private_dir(path: Path, *, others_may_write: bool = False) -> Path:
    """``path`` as a directory of this user (created 0700 when missing), refused otherwise.

    A predictable directory under ``/tmp`` could have been created by someone else first, and
    whoever can write a directory can swap the token file in it for one of their own.
    ``others_may_write``: only the owner is checked (Ray makes its own temp dir world-writable).
    """
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise ClusterError(f"{path} is a symlink or not a directory: refusing to keep the cluster's state there "
                           "(set cluster.temp_dir to a directory of your own)")
    if st.st_uid != os.getuid() or (st.st_mode & 0o022 and not others_may_write):
        raise ClusterError(f"{path} is owned by uid {st.st_uid} with mode {stat.filemode(st.st_mode)}: others could "
                           "replace the cluster's files there (set cluster.temp_dir to a directory of your own, "
                           "or remove this one)")
    return path


def write_token_file(directory: Path) -> Path:
    """A fresh random token (256 bits) in ``directory/ray_auth_token``, mode 0600, written atomically."""
    path = private_dir(directory) / TOKEN_FILE
    with atomic_path(path) as tmp:  # mkstemp: created 0600
        tmp.write_text(secrets.token_hex(32))
        os.chmod(tmp, 0o600)
    return path


def check_token_file(path: Path) -> Path:
    """``path`` when it is a non-empty token file only its owner can read; refused otherwise.

    Reads the file's metadata, never the token: for what prints or passes on the path.
    """
    try:
        st = os.stat(path)
    except OSError as e:
        raise ClusterError(_unreadable(path, e)) from e
    if st.st_mode & 0o077:
        raise ClusterError(f"the Ray token file {path} has mode {stat.filemode(st.st_mode)}: others can read it "
                           f"(fix: chmod 600 {path}, then provision a fresh cluster: the token may be known)")
    if st.st_size == 0:
        raise ClusterError(f"the Ray token file {path} is empty: provision the cluster again")
    return path


def read_token_file(path: Path) -> str:
    """The token in ``path``; refuses a file that others can read (the token would not be secret)."""
    check_token_file(path)
    try:
        token = path.read_text().strip()
    except OSError as e:
        raise ClusterError(_unreadable(path, e)) from e
    if not token:
        raise ClusterError(f"the Ray token file {path} is empty: provision the cluster again")
    return token


def _unreadable(path: Path, error: OSError) -> str:
    return (f"cannot read the Ray token file {path}: {error} (the cluster was started by another user "
            "or its state directory was removed: provision the cluster again)")


def ray_env(mode: AuthMode, token_file: Path | None) -> dict[str, str | None]:
    """Ray's auth variables for the processes of a cluster (None = remove it from the environment).

    A ``RAY_AUTH_TOKEN`` inherited from the caller would win over the file: it is removed.
    """
    if mode is AuthMode.TOKEN:
        if token_file is None:
            raise ClusterError("token auth needs the cluster's token file")
        return {MODE_VAR: mode.value, TOKEN_PATH_VAR: str(token_file), TOKEN_VAR: None}
    return {MODE_VAR: mode.value, TOKEN_PATH_VAR: None, TOKEN_VAR: None}


def apply_env(env: dict[str, str], changes: dict[str, str | None]) -> dict[str, str]:
    """``env`` with ``changes`` applied (a None value removes the variable)."""
    out = dict(env)
    for key, value in changes.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


#: Environment variable names that hold a secret (``HF_TOKEN``, ``WANDB_API_KEY``, ``AWS_SECRET_ACCESS_KEY`` …).
_SECRET_NAME = re.compile(r"(^|_)(TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|ACCESS_KEY|CREDENTIALS?|PRIVATE_KEY)(_|$)")


def check_job_env(env: dict[str, Any], key: str) -> None:
    """Refuse a secret in a job's ``runtime_env`` env_vars: anyone who can read the Jobs API reads it."""
    for name in env:
        upper = str(name).upper()
        if _SECRET_NAME.search(upper) and not upper.endswith(("_PATH", "_FILE", "_DIR")):  # a path is fine
            raise ConfigError(f"{key}.{name}", "***", "a secret in the job's runtime_env is readable by anyone who "
                              "can read the Ray Jobs API (job info returns it)",
                              "put it in a file on the nodes (mode 0600) and set a variable naming its path, "
                              f"e.g. {name}_FILE or the tool's own *_PATH setting")


def is_loopback(host: str) -> bool:
    if host.lower() in ("localhost", "localhost.localdomain") or host.lower().endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_problem(url: str, mode: AuthMode, *, allowed: bool,
                     key: str = "cluster.dashboard_url") -> ConfigError | None:
    """The error refusing the dashboard at ``url``, or None when the pipeline may use it.

    Refused: auth disabled on a dashboard that is neither on loopback nor behind ``https``, unless
    the profile says ``allow_insecure: true``.
    """
    if mode is AuthMode.TOKEN or allowed:
        return None
    parts = urlsplit(url)
    if parts.scheme == "https" or is_loopback(parts.hostname or ""):
        return None
    return ConfigError(
        key, url, f"auth_mode is disabled and this dashboard is neither on loopback nor https: {SHADOWRAY}",
        "start the cluster with RAY_AUTH_MODE=token and set auth_mode: token (the token as the Airflow "
        "connection's password), or serve the dashboard over https, or set allow_insecure: true in the cluster "
        "profile if only trusted hosts can reach the port")
