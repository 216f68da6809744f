#!/usr/bin/env bash
# System packages the integration tests use: PostgreSQL (the scheduler's metadata DB) and Chromium
# (the UI test, driven by Playwright through executable_path; no browser is downloaded).
# Debian packages, installed only when missing. Without root or apt-get it says so and exits 0:
# the tests then skip (or fail when CI is set).
set -euo pipefail
need=()
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need+=(postgresql)
command -v chromium >/dev/null 2>&1 || need+=(chromium chromium-driver)
if [ ${#need[@]} -eq 0 ]; then
  echo "system-deps: postgresql and chromium present"
  exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "system-deps: missing ${need[*]} and cannot install (needs root + apt-get); their tests will skip" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq "${need[@]}" >/dev/null
echo "system-deps: installed ${need[*]}"
