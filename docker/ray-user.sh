#!/bin/sh
# The non-root user of the Ray images (GPU and CPU): `ray` with UID $1 and GID 0, like the Airflow image's
# `airflow`, and the mount points of the shared volumes owned by it (a new named volume copies the
# ownership of its mount point, so every container can write /shared/*).
set -eu
uid=${1:?usage: ray-user.sh UID}
useradd --uid "$uid" --gid 0 --create-home --home-dir /home/ray --shell /bin/bash ray
mkdir -p /shared/data /shared/models /shared/checkpoints /shared/runs
chown -R "$uid:0" /shared
chmod -R g+rwX /shared
