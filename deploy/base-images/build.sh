#!/usr/bin/env bash
# Stand-ins for the base images deploy/ starts from (python:3.12-slim for the Dockerfile,
# postgres:16 for the compose stack and the smoke), built on a machine that cannot reach a
# container registry, from a Debian root file system made with debootstrap:
#
#   debootstrap --variant=minbase --include=python3,python3-venv,postgresql,ca-certificates \
#       bookworm /srv/bookworm http://deb.debian.org/debian          (as root; any Debian mirror)
#   deploy/base-images/build.sh /srv/bookworm          (a folder, or a tar file of one)
#
# They take the official names so that nothing else changes, and say what they are in a label:
# Debian's Python (3.11 on bookworm) in a venv on the PATH, as `python` and `pip`, and Debian's
# PostgreSQL (15 on bookworm) behind an entrypoint that does what deploy/ asks of the official
# one (postgres-entrypoint.sh). Where a registry is reachable from another machine, `docker pull`
# the official images there, `docker save` them to a file and `docker load` it here instead.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
engine=${ENGINE:-docker}
[ $# -eq 1 ] || { echo "usage: $0 ROOTFS_FOLDER_OR_TAR" >&2; exit 2; }
if [ -d "$1" ]; then
  tar -C "$1" -c . | "$engine" import - local/debian-rootfs:bookworm
else
  "$engine" import "$1" local/debian-rootfs:bookworm
fi
"$engine" build -t python:3.12-slim -f "$here/python.Dockerfile" "$here"
"$engine" build -t postgres:16 -f "$here/postgres.Dockerfile" "$here"
echo "built python:3.12-slim and postgres:16 (stand-ins) from $1"
