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
#
# The certificate authorities this machine adds to Debian's (the *.crt files in
# /usr/local/share/ca-certificates, or in the folder CA_CERTS names; CA_CERTS=none for none) are
# trusted in the python image too: on a network that re-signs TLS (an inspecting proxy), pip in
# deploy/Dockerfile could not reach the package index otherwise.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
engine=${ENGINE:-docker}
cas=${CA_CERTS:-/usr/local/share/ca-certificates}
[ $# -eq 1 ] || { echo "usage: $0 ROOTFS_FOLDER_OR_TAR" >&2; exit 2; }
if [ -d "$1" ]; then
  tar -C "$1" -c . | "$engine" import - local/debian-rootfs:bookworm
else
  "$engine" import "$1" local/debian-rootfs:bookworm
fi
context=$(mktemp -d)
trap 'rm -rf "$context"' EXIT
cp "$here/python.Dockerfile" "$here/postgres.Dockerfile" "$here/postgres-entrypoint.sh" "$context/"
mkdir "$context/ca-certificates"
if [ "$cas" != none ] && [ -d "$cas" ]; then
  find "$cas" -maxdepth 1 -name '*.crt' -exec cp {} "$context/ca-certificates/" \;
fi
echo "trusting $(find "$context/ca-certificates" -name '*.crt' | wc -l) added certificate authorities ($cas)"
"$engine" build -t python:3.12-slim -f "$context/python.Dockerfile" "$context"
"$engine" build -t postgres:16 -f "$context/postgres.Dockerfile" "$context"
echo "built python:3.12-slim and postgres:16 (stand-ins) from $1"
