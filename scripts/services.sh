#!/usr/bin/env bash
# Make sure the services the integration tests need are installed and running.
#
# Sourced by scripts/test. On a fresh Debian machine it installs redis-server and
# PostgreSQL from Debian's packages; it reuses a PostgreSQL already listening on
# 127.0.0.1:5432 and otherwise starts a private cluster on port 55432.
# Exports GRAVITON_TEST_DATABASE_URL for the tests. Tests start their own redis-server
# processes (one per test), so only the binary must exist.
set -euo pipefail

apt_updated=0
apt_install() {
  if [ "$(id -u)" != 0 ]; then
    echo "scripts/services.sh: need root to install $* (or install it yourself)" >&2
    return 1
  fi
  if [ "$apt_updated" = 0 ]; then
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    apt_updated=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

if ! command -v redis-server >/dev/null 2>&1; then
  echo "installing redis-server" >&2
  apt_install redis-server
fi

pg_bin_dir() {
  local d
  for d in /usr/lib/postgresql/*/bin; do
    if [ -x "$d/pg_ctl" ]; then echo "$d"; return 0; fi
  done
  return 1
}

pg_ready() { # host port
  if command -v pg_isready >/dev/null 2>&1; then
    pg_isready -q -h "$1" -p "$2"
  else
    (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null
  fi
}

if [ -n "${GRAVITON_TEST_DATABASE_URL:-}" ]; then
  : # caller chose a server
elif pg_ready 127.0.0.1 5432 && psql -h 127.0.0.1 -U postgres -d postgres -c 'select 1' >/dev/null 2>&1; then
  export GRAVITON_TEST_DATABASE_URL="postgres://postgres@127.0.0.1:5432/postgres"
else
  if ! pg_bin_dir >/dev/null; then
    echo "installing postgresql" >&2
    apt_install postgresql
  fi
  bin="$(pg_bin_dir)"
  port=55432
  dir="${GRAVITON_PG_DIR:-/tmp/graviton-pg}"
  if ! pg_ready 127.0.0.1 "$port"; then
    echo "starting a private PostgreSQL on 127.0.0.1:$port ($dir)" >&2
    mkdir -p "$dir"
    chown postgres:postgres "$dir" 2>/dev/null || true
    run_pg() { if [ "$(id -u)" = 0 ]; then su postgres -s /bin/sh -c "$*"; else sh -c "$*"; fi; }
    if [ ! -f "$dir/PG_VERSION" ]; then
      run_pg "'$bin/initdb' -D '$dir' -A trust -U postgres >/dev/null"
    fi
    run_pg "'$bin/pg_ctl' -D '$dir' -o \"-p $port -k '$dir' -c listen_addresses=127.0.0.1 -c max_connections=300\" -l '$dir/log' -w start >/dev/null"
  fi
  export GRAVITON_TEST_DATABASE_URL="postgres://postgres@127.0.0.1:$port/postgres"
fi
echo "services: redis-server=$(command -v redis-server) postgres=${GRAVITON_TEST_DATABASE_URL}" >&2
