#!/bin/sh
# Entrypoint of the PostgreSQL stand-in (postgres.Containerfile): the part of the official
# image's docker-entrypoint.sh that compose.yaml relies on. On the first start (an empty PGDATA,
# a new volume) it creates the cluster with POSTGRES_USER (superuser, default postgres) and
# POSTGRES_PASSWORD, password (scram-sha-256) logins from any address, and POSTGRES_DB; later
# starts use what the volume holds. The server runs as user postgres, never root.
set -eu

if [ "${1:-}" = postgres ] && [ "$(id -u)" = 0 ]; then
    mkdir -p "$PGDATA" /run/postgresql
    chown postgres:postgres "$PGDATA" /run/postgresql
    chmod 0700 "$PGDATA"
    exec setpriv --reuid=postgres --regid=postgres --init-groups "$0" "$@"
fi

if [ "${1:-}" = postgres ] && [ ! -s "$PGDATA/PG_VERSION" ]; then
    : "${POSTGRES_PASSWORD:?is required (the official image refuses to start without it too)}"
    user="${POSTGRES_USER:-postgres}"
    db="${POSTGRES_DB:-$user}"
    pwfile="$(mktemp)"
    printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile"
    initdb --username="$user" --pwfile="$pwfile" --auth-local=trust --auth-host=scram-sha-256 \
        --encoding=UTF8 -D "$PGDATA" > /dev/null
    rm -f "$pwfile"
    echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
    echo "listen_addresses = '*'" >> "$PGDATA/postgresql.auto.conf"
    if [ "$db" != postgres ]; then
        # Local socket only while setting up: nobody connects before the database exists.
        pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start > /dev/null
        psql -v ON_ERROR_STOP=1 --username "$user" --dbname postgres -q \
            -c "CREATE DATABASE \"$db\""
        pg_ctl -D "$PGDATA" -m fast -w stop > /dev/null
    fi
    echo "stand-in postgres: cluster created in $PGDATA (user $user, database $db)"
fi

exec "$@"
