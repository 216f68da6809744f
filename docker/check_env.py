"""Checks the settings of the compose stack (.env) before anything starts; one line per problem.

In the stack it is the ``env-check`` service, which every other service waits for: it reads the
values compose passes it from the environment. On the host it reads an env file:

    python3 docker/check_env.py [--env-file .env]

Exit status 0 when every value is usable, 1 otherwise, with one line per problem naming the
variable, its value (``***`` for a secret), the rule and the fix. In the stack a missing secret
never gets here: compose itself refuses it first (``required variable ... is missing a value``).
Standard library only: it runs in the plain Python base image and on any host with python3.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import itertools
import os
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

PLACEHOLDER = "CHANGE_ME"
#: Secrets of the stack and how to make a good one.
SECRETS = {
    "POSTGRES_PASSWORD": "openssl rand -hex 24",
    "AIRFLOW_ADMIN_PASSWORD": "openssl rand -base64 18",
    "AIRFLOW_FERNET_KEY": 'python3 -c "import base64, os; print(base64.urlsafe_b64encode(os.urandom(32)).decode())"',
    "AIRFLOW_JWT_SECRET": "openssl rand -hex 32",
    "AIRFLOW_API_SECRET_KEY": "openssl rand -hex 32",
    "RAY_AUTH_TOKEN": "openssl rand -hex 32",
}
#: Characters that survive a connection URL (POSTGRES_PASSWORD) and a JSON string (RAY_AUTH_TOKEN) unquoted.
URL_SAFE = re.compile(r"[A-Za-z0-9._~-]+")
#: The fewest characters of a secret (the JWT secret and the Fernet key have rules of their own); what
#: SECRETS' commands make is longer: 48, 24, 64 and 64.
MIN_CHARS = {
    "POSTGRES_PASSWORD": 16,
    "AIRFLOW_ADMIN_PASSWORD": 12,
    "AIRFLOW_API_SECRET_KEY": 32,
    "RAY_AUTH_TOKEN": 32,
}
#: Airflow signs its task tokens with HS512 when the JWT secret is set; RFC 7518 (3.2) asks an HMAC key
#: of at least the hash's size, 64 bytes, and PyJWT warns below it.
MIN_JWT_SECRET_BYTES = 64
#: A random secret of the sizes above has far more different characters (or bytes) than this.
MIN_DISTINCT = 8
#: Words a guesser tries first (the defaults of Airflow's own compose file among them); five letters or
#: more, so that a random value holds one by chance about once in a million.
GUESSED_WORDS = ("airflow", "admin", "password", "postgres", "secret", "changeme", "letmein", "qwerty")
EXECUTORS = ("LocalExecutor", "CeleryExecutor")


def _problem(name: str, value: str, rule: str, fix: str) -> str:
    shown = "***" if name in SECRETS and value else value
    return f"{name}={shown!r}: {rule} (fix: {fix})"


def _secret(name: str, value: str) -> str | None:
    if not value:
        return _problem(name, value, "is missing or empty", f"set it in .env: {SECRETS[name]}")
    if PLACEHOLDER in value:
        return _problem(name, value, f"still holds the {PLACEHOLDER} placeholder of .env.example",
                        f"replace it in .env: {SECRETS[name]}")
    return None


def _fernet(name: str, value: str) -> str | None:
    try:
        ok = len(base64.urlsafe_b64decode(value.encode())) == 32
    except (binascii.Error, ValueError):
        ok = False
    return None if ok else _problem(name, value, "is not a Fernet key (32 bytes, url-safe base64)",
                                    f"set it in .env: {SECRETS[name]}")


def _url_safe(name: str, value: str) -> str | None:
    if URL_SAFE.fullmatch(value):
        return None
    return _problem(name, value, "has characters a URL or JSON string cannot carry as they are (allowed: "
                    "letters, digits, . _ ~ -)", f"set it in .env: {SECRETS[name]}")


def _long_enough(name: str, value: str) -> str | None:
    low = MIN_CHARS[name]
    if len(value) >= low:
        return None
    return _problem(name, value, f"is {len(value)} long; it needs at least {low} characters",
                    f"set it in .env: {SECRETS[name]}")


def weakness(value: str | bytes) -> str | None:
    """Why a secret of enough characters is still easy to guess, None when nothing shows: a pattern
    repeated (``aaaa``, ``abab``), a run in sequence (``abcd``), few different characters, a guessed word."""
    unit = "byte" if isinstance(value, bytes) else "character"
    for period in range(1, len(value) // 2 + 1):
        if value[period:] == value[:-period]:
            return f"repeats one {unit}" if period == 1 else f"repeats a pattern of {period} {unit}s"
    codes = list(value) if isinstance(value, bytes) else [ord(c) for c in value]
    if len({b - a for a, b in itertools.pairwise(codes)}) == 1:
        return f"is a run of {unit}s in sequence"
    if len(set(codes)) < MIN_DISTINCT:
        return f"has only {len(set(codes))} different {unit}s (a random one has far more)"
    if isinstance(value, str):
        word = next((w for w in GUESSED_WORDS if w in value.lower()), None)
        if word:
            return f"contains the word {word!r}, one of the first a guesser tries"
    return None


def _strong(name: str, value: str) -> str | None:
    # The Fernet key's strength is that of the 32 bytes it decodes to (all-zero bytes make a valid key).
    reason = weakness(base64.urlsafe_b64decode(value.encode()) if name == "AIRFLOW_FERNET_KEY" else value)
    if reason is None:
        return None
    return _problem(name, value, f"{reason}: it is easy to guess", f"set it in .env: {SECRETS[name]}")


def _jwt_secret(name: str, value: str) -> str | None:
    size = len(value.encode())
    if size >= MIN_JWT_SECRET_BYTES:
        return None
    return _problem(name, value, f"is {size} bytes; Airflow signs with HS512, whose key needs at least "
                    f"{MIN_JWT_SECRET_BYTES}", f"set it in .env: {SECRETS[name]}")


def _int(low: int, high: int, example: str) -> Callable[[str, str], str | None]:
    def check(name: str, value: str) -> str | None:
        if value.isdigit() and low <= int(value) <= high:
            return None
        return _problem(name, value, f"must be a whole number from {low} to {high}", f"{name}={example}")

    return check


def _uid(name: str, value: str) -> str | None:
    if value.isdigit() and int(value) >= 1:
        return None
    return _problem(name, value, "must be a numeric user id other than 0 (the containers do not run as root)",
                    f"{name}=50000")


def _executor(name: str, value: str) -> str | None:
    if value in EXECUTORS:
        return None
    return _problem(name, value, f"must be one of {', '.join(EXECUTORS)}", f"{name}=LocalExecutor")


#: The rules of each secret beyond being set and not the placeholder, in order: its form, its size, then
#: its strength (the first problem is the one shown).
SECRET_RULES: dict[str, tuple[Callable[[str, str], str | None], ...]] = {
    "POSTGRES_PASSWORD": (_url_safe, _long_enough, _strong),
    "AIRFLOW_ADMIN_PASSWORD": (_long_enough, _strong),
    "AIRFLOW_FERNET_KEY": (_fernet, _strong),
    "AIRFLOW_JWT_SECRET": (_jwt_secret, _strong),
    "AIRFLOW_API_SECRET_KEY": (_long_enough, _strong),
    "RAY_AUTH_TOKEN": (_url_safe, _long_enough, _strong),
}
#: Non-secret values: the check of each (only when set; compose gives the defaults).
RULES: dict[str, Callable[[str, str], str | None]] = {
    "AIRFLOW_EXECUTOR": _executor,
    "AIRFLOW_API_PORT": _int(1, 65535, "8080"),
    "RAY_DASHBOARD_PORT": _int(1, 65535, "8265"),
    "APP_UID": _uid,
    "RAY_HEAD_NUM_GPUS": _int(0, 64, "1"),
    "RAY_WORKER_NUM_GPUS": _int(0, 64, "1"),
    "RAY_WORKER_REPLICAS": _int(0, 64, "1"),
}


def problems(env: Mapping[str, str]) -> list[str]:
    """Every problem of ``env`` (the stack's variables), one line each; empty when all are usable."""
    out: list[str] = []
    for name in SECRETS:
        value = env.get(name, "")
        problem = _secret(name, value)
        for rule in SECRET_RULES[name]:
            problem = problem or rule(name, value)
        if problem:
            out.append(problem)
    # One value in two places: whoever learns one of them (the DB password from a URL, say) has both.
    seen: dict[str, str] = {}
    for name in SECRETS:
        value = env.get(name, "")
        if value and value in seen:
            out.append(_problem(name, value, f"is the value of {seen[value]} too: each secret needs its own",
                                f"set it in .env: {SECRETS[name]}"))
        seen.setdefault(value, name)
    for name, check in RULES.items():
        value = env.get(name, "")
        if value:
            problem = check(name, value)
            if problem:
                out.append(problem)
    if env.get("AIRFLOW_API_PORT") and env.get("AIRFLOW_API_PORT") == env.get("RAY_DASHBOARD_PORT"):
        out.append(_problem("RAY_DASHBOARD_PORT", env["RAY_DASHBOARD_PORT"], "is AIRFLOW_API_PORT too: "
                            "both are published on 127.0.0.1", "RAY_DASHBOARD_PORT=8265"))
    celery = "celery" in env.get("COMPOSE_PROFILES", "").split(",")
    if (env.get("AIRFLOW_EXECUTOR") == "CeleryExecutor") != celery and "COMPOSE_PROFILES" in env:
        out.append(_problem("AIRFLOW_EXECUTOR", env.get("AIRFLOW_EXECUTOR", ""),
                            "and COMPOSE_PROFILES disagree: CeleryExecutor needs the celery profile "
                            "(redis + airflow-worker), and that profile is idle without it",
                            "set both (AIRFLOW_EXECUTOR=CeleryExecutor, COMPOSE_PROFILES=celery) or neither"))
    return out


def read_env_file(path: Path) -> dict[str, str]:
    """``KEY=VALUE`` lines as compose reads them (comments, blank lines, optional quotes, ``export``)."""
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        m = re.match(r"\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)\s*=(.*)$", line)
        if not m:
            continue
        value = m.group(2).strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        elif " #" in value:
            value = value.split(" #", 1)[0].rstrip()
        out[m.group(1)] = value
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--env-file", type=Path, help="read this file (as compose does) instead of the environment")
    args = ap.parse_args(argv)
    if args.env_file is not None:
        if not args.env_file.is_file():
            print(f"{args.env_file}: no such file (fix: cp .env.example {args.env_file} and edit it)", file=sys.stderr)
            return 1
        env = read_env_file(args.env_file)
    else:
        env = dict(os.environ)
    found = problems(env)
    for line in found:
        print(f"env-check: {line}", file=sys.stderr)
    if not found:
        print("env-check: .env accepted")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
