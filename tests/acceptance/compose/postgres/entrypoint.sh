#!/bin/sh
# The official image's contract, reduced to what the compose file uses: initialise an empty
# PGDATA with POSTGRES_USER / POSTGRES_PASSWORD / POSTGRES_DB, password auth over TCP,
# trust on the local socket, then run the server as the postgres user.
set -eu
if [ "${1:-}" = "postgres" ]; then
  user="${POSTGRES_USER:-postgres}"
  db="${POSTGRES_DB:-$user}"
  mkdir -p "$PGDATA" /var/run/postgresql
  chown -R postgres:postgres "$PGDATA" /var/run/postgresql
  chmod 700 "$PGDATA"
  if [ ! -s "$PGDATA/PG_VERSION" ]; then
    : "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD must be set}"
    pwfile="$(mktemp)"
    printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile"
    chown postgres "$pwfile"
    gosu postgres initdb -D "$PGDATA" -U "$user" --pwfile="$pwfile" \
      --auth-local=trust --auth-host=scram-sha-256 --encoding=UTF8 >/dev/null
    rm -f "$pwfile"
    echo "listen_addresses = '*'" >> "$PGDATA/postgresql.conf"
    echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
    gosu postgres pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start >/dev/null
    if [ "$db" != "postgres" ]; then
      gosu postgres psql -v ON_ERROR_STOP=1 -U "$user" -d postgres -q \
        -c "CREATE DATABASE \"$db\" OWNER \"$user\""
    fi
    gosu postgres pg_ctl -D "$PGDATA" -m fast -w stop >/dev/null
    echo "entrypoint: initialised $PGDATA (user $user, database $db)"
  fi
  exec gosu postgres "$@"
fi
exec "$@"
