#!/usr/bin/env bash
# Make sure the services the integration tests need are installed and running.
#
# Sourced by scripts/test. On a fresh Debian machine it installs redis-server and
# PostgreSQL from Debian's packages; it reuses a PostgreSQL already listening on
# 127.0.0.1:5432 and otherwise starts a private cluster on port 55432.
# Exports GRAVITON_TEST_DATABASE_URL for the tests. Tests start their own redis-server
# processes (one per test), so only the binary must exist.
# fuse3 (fusermount3) is installed for the power-loss tests, which mount a FUSE filesystem
# of their own (/dev/fuse must exist).
# Garage (an S3-compatible store) is installed with `cargo install garage --locked` unless
# a binary is on PATH or in ~/.cargo/bin, and started as a single node (replication
# factor 1, data and metadata fsync on) on 127.0.0.1:3900; the GRAVITON_TEST_S3_* variables
# tell the tests where it is. Set GRAVITON_SKIP_GARAGE=1 to leave it out.
set -euo pipefail

# Debian packages go through scripts/apt-install (one apt run at a time).
apt_install() {
  "$(dirname "${BASH_SOURCE[0]}")/apt-install" "$@"
}

if ! command -v redis-server >/dev/null 2>&1; then
  echo "installing redis-server" >&2
  apt_install redis-server
fi

# The power-loss tests mount a FUSE filesystem of their own (tests/support/lazyfs.rs).
if ! command -v fusermount3 >/dev/null 2>&1; then
  echo "installing fuse3" >&2
  apt_install fuse3
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
garage_bin() {
  if command -v garage >/dev/null 2>&1; then command -v garage; return 0; fi
  if [ -x "$HOME/.cargo/bin/garage" ]; then echo "$HOME/.cargo/bin/garage"; return 0; fi
  return 1
}

s3_port=3900
if [ "${GRAVITON_SKIP_GARAGE:-0}" != 1 ]; then
  if ! garage_bin >/dev/null; then
    echo "installing garage (cargo install garage --locked; about 15 minutes)" >&2
    cargo install garage --locked >&2
  fi
  gbin="$(garage_bin)"
  gdir="${GRAVITON_GARAGE_DIR:-/tmp/graviton-garage}"
  export GRAVITON_TEST_S3_ENDPOINT="http://127.0.0.1:$s3_port"
  export GRAVITON_TEST_S3_BUCKET="graviton-test"
  export GRAVITON_TEST_S3_REGION="garage"
  export GRAVITON_TEST_S3_ACCESS_KEY="GKgravitontest0001"
  export GRAVITON_TEST_S3_SECRET_KEY="graviton-test-secret-key-0123456789abcdef"
  export GRAVITON_GARAGE_BIN="$gbin"
  export GRAVITON_GARAGE_CONFIG="$gdir/garage.toml"
  if ! (exec 3<>"/dev/tcp/127.0.0.1/$s3_port") 2>/dev/null; then
    echo "starting garage single node on 127.0.0.1:$s3_port ($gdir)" >&2
    mkdir -p "$gdir"
    if [ ! -f "$gdir/garage.toml" ]; then
      cat >"$gdir/garage.toml" <<EOT
metadata_dir = "$gdir/meta"
data_dir = "$gdir/data"
db_engine = "sqlite"
replication_factor = 1
metadata_fsync = true
data_fsync = true
rpc_bind_addr = "127.0.0.1:3901"
rpc_public_addr = "127.0.0.1:3901"
rpc_secret = "$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')"

[s3_api]
api_bind_addr = "127.0.0.1:$s3_port"
s3_region = "garage"

[admin]
api_bind_addr = "127.0.0.1:3903"
EOT
    fi
    GARAGE_DEFAULT_ACCESS_KEY="$GRAVITON_TEST_S3_ACCESS_KEY" \
    GARAGE_DEFAULT_SECRET_KEY="$GRAVITON_TEST_S3_SECRET_KEY" \
    GARAGE_DEFAULT_BUCKET="$GRAVITON_TEST_S3_BUCKET" \
      nohup "$gbin" -c "$gdir/garage.toml" server --single-node --default-access-key --default-bucket \
      >"$gdir/log" 2>&1 &
    for _ in $(seq 1 100); do
      if (exec 3<>"/dev/tcp/127.0.0.1/$s3_port") 2>/dev/null; then break; fi
      sleep 0.2
    done
  fi
fi
echo "services: redis-server=$(command -v redis-server) postgres=${GRAVITON_TEST_DATABASE_URL} s3=${GRAVITON_TEST_S3_ENDPOINT:-none}" >&2
