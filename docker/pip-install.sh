#!/bin/sh
# `pip install` from the package sources a build names; every image of the project installs through it.
#   TORCH_INDEX_URL  the index torch comes from (empty: the same sources as everything else). PyPI's
#                    torch for Linux x86-64 is the CUDA build (~3 GB of nvidia-* wheels, it runs on CPU
#                    too); https://download.pytorch.org/whl/cpu has the CPU build.
#   PIP_INDEX        an index instead of PyPI for everything (a mirror, or an air-gapped site's own).
#   FIND_LINKS       a URL of a wheel directory pip looks at besides the index.
#   /opt/wheels      docker/wheels/ of the build context (see its README.md): pip looks there first,
#                    e.g. for torch's CPU build copied from a machine's local disk.
# Usage: pip-install.sh torch==VERSION     torch alone (from TORCH_INDEX_URL when it is set)
#        pip-install.sh PIP_ARGS...        anything else
# Build arguments are recorded in the image's history (`docker history`): never put a credential in one.
set -eu
torch_only=0
case "$*" in torch==*) [ "$#" -eq 1 ] && torch_only=1 ;; esac
set -- --find-links /opt/wheels "$@"
if [ -n "${FIND_LINKS:-}" ]; then set -- --find-links "$FIND_LINKS" "$@"; fi
if [ "$torch_only" = 1 ] && [ -n "${TORCH_INDEX_URL:-}" ]; then
  set -- --index-url "$TORCH_INDEX_URL" "$@"
elif [ -n "${PIP_INDEX:-}" ]; then
  set -- --index-url "$PIP_INDEX" "$@"
fi
echo "pip install $*"
exec python -m pip install --no-cache-dir "$@"
