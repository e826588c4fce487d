#!/usr/bin/env bash
# PostgreSQL for the control plane's tests (crates/sbx-control): Debian's `postgresql`
# (installed when missing), its cluster started when it is not running, a role and a database
# `sbx_test` (password auth on 127.0.0.1; the role may create databases: each test makes its
# own and drops it). Idempotent and fast when all is there. As root.
#
#   scripts/postgres.sh [start]   prints the URL on stdout (everything else goes to stderr):
#                                 export SBX_TEST_PG_URL="$(scripts/postgres.sh)"
#   scripts/postgres.sh stop      stops the cluster (if it runs)
#
# The password is made once and kept in $SBX_PG_PASSWORD_FILE (default
# /var/lib/postgresql/sbx_test.password, root only); the role is given it at every start.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/lib.sh"
need_root

action="${1:-start}"
case "$action" in
  start | stop) ;;
  *)
    echo "usage: $0 [start|stop]" >&2
    exit 2
    ;;
esac

cluster_field() { # VERSION FIELD(3 port, 4 status): of the cluster `main` of that version
  pg_lsclusters -h | awk -v v="$1" -v f="$2" '$1 == v && $2 == "main" { print $f }'
}

if [ "$action" = stop ]; then
  command -v pg_lsclusters >/dev/null 2>&1 || exit 0
  pg_lsclusters -h | awk '$2 == "main" && $4 ~ /online/ { print $1 }' | while read -r v; do
    echo "sbx: stopping PostgreSQL $v main" >&2
    pg_ctlcluster "$v" main stop >&2
  done
  exit 0
fi

install_packages postgresql

# The newest version that has a cluster `main`; else the newest installed, given one.
version="$(pg_lsclusters -h | awk '$2 == "main" { print $1 }' | sort -V | tail -n1)"
if [ -z "$version" ]; then
  version="$(ls /usr/lib/postgresql | sort -V | tail -n1)"
  if [ -z "$version" ]; then
    echo "sbx: postgresql is installed, but no server version is in /usr/lib/postgresql" >&2
    exit 1
  fi
  echo "sbx: creating the PostgreSQL $version cluster main" >&2
  pg_createcluster "$version" main >&2
fi
port="$(cluster_field "$version" 3)"
if [[ "$(cluster_field "$version" 4)" != online* ]]; then
  echo "sbx: starting PostgreSQL $version main (port $port)" >&2
  pg_ctlcluster "$version" main start >&2
fi
for _ in $(seq 1 100); do
  pg_isready -q -h 127.0.0.1 -p "$port" && break
  sleep 0.1
done
if ! pg_isready -q -h 127.0.0.1 -p "$port"; then
  echo "sbx: PostgreSQL $version main does not answer on 127.0.0.1:$port" \
    "(log: /var/log/postgresql/postgresql-$version-main.log)" >&2
  exit 1
fi

pwfile="${SBX_PG_PASSWORD_FILE:-/var/lib/postgresql/sbx_test.password}"
if [ ! -s "$pwfile" ]; then
  (umask 077 && head -c 32 /dev/urandom | base64 | tr -dc 'A-Za-z0-9' | head -c 24 >"$pwfile")
fi
chmod 600 "$pwfile"
password="$(cat "$pwfile")"

# As the cluster's superuser, over its socket (peer auth). The password goes through stdin,
# not the command line.
runuser -u postgres -- psql -q -v ON_ERROR_STOP=1 -p "$port" -d postgres >&2 <<SQL
SELECT 'CREATE ROLE sbx_test LOGIN CREATEDB'
  WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'sbx_test') \gexec
ALTER ROLE sbx_test WITH LOGIN CREATEDB PASSWORD '$password';
SELECT 'CREATE DATABASE sbx_test OWNER sbx_test'
  WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = 'sbx_test') \gexec
SQL

echo "postgres://sbx_test:$password@127.0.0.1:$port/sbx_test"
