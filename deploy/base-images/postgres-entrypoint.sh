#!/bin/sh
# The part of the official postgres image's entrypoint that deploy/ relies on, for the stand-in
# image (postgres.Dockerfile): on first start, a cluster in $PGDATA whose superuser is
# $POSTGRES_USER with $POSTGRES_PASSWORD, and a database $POSTGRES_DB; local connections are
# trusted (pg_isready, psql in the container), others need the password; the server then runs as
# PID 1 as user postgres, listening on every address. Extra arguments after `postgres` are
# passed on (`postgres -c port=5433`). POSTGRES_SOCKET_DIR moves the socket folder.
set -eu
: "${POSTGRES_USER:=postgres}"
: "${POSTGRES_DB:=$POSTGRES_USER}"
: "${PGDATA:=/var/lib/postgresql/data}"
SOCKETS=${POSTGRES_SOCKET_DIR:-/var/run/postgresql}
[ "${1:-postgres}" = postgres ] || exec "$@"
[ $# -gt 0 ] && shift

if [ "$(id -u)" = 0 ]; then
  mkdir -p "$PGDATA" "$SOCKETS"
  chown -R postgres:postgres "$PGDATA" "$SOCKETS"
  chmod 700 "$PGDATA"
  exec setpriv --reuid=postgres --regid=postgres --init-groups "$0" postgres "$@"
fi

if [ ! -s "$PGDATA/PG_VERSION" ]; then
  if [ -z "${POSTGRES_PASSWORD:-}" ]; then
    echo "postgres-entrypoint: POSTGRES_PASSWORD is not set" >&2
    exit 1
  fi
  pwfile=$(mktemp)
  printf '%s\n' "$POSTGRES_PASSWORD" >"$pwfile"
  initdb -D "$PGDATA" -U "$POSTGRES_USER" --pwfile="$pwfile" -E UTF8 --locale=C.UTF-8 --auth-local=trust \
    --auth-host=scram-sha-256 >/dev/null
  rm -f "$pwfile"
  echo "host all all all scram-sha-256" >>"$PGDATA/pg_hba.conf"
  if [ "$POSTGRES_DB" != postgres ]; then
    db=$(printf '%s' "$POSTGRES_DB" | sed 's/"/""/g')
    echo "CREATE DATABASE \"$db\"" \
      | postgres --single -D "$PGDATA" -c unix_socket_directories="$SOCKETS" postgres >/dev/null
  fi
  echo "postgres-entrypoint: created the cluster in $PGDATA" >&2
fi
exec postgres -D "$PGDATA" -c listen_addresses='*' -c unix_socket_directories="$SOCKETS" "$@"
