#!/bin/sh
# The Prefect server on PostgreSQL, as the prefect-server service runs it (and the tests, natively).
#   PREFECT_API_DATABASE_CONNECTION_URL  postgresql+asyncpg://user:password@host:5432/prefect
#   PREFECT_SERVER_API_HOST / _PORT      where to listen (default 127.0.0.1:4200)
#   or POSTGRES_USER, POSTGRES_PASSWORD [, POSTGRES_HOST]: the URL is built from them, encoded
set -eu
. "$(dirname "$0")/database-url.sh"
if [ -z "${PREFECT_API_DATABASE_CONNECTION_URL:-}" ] && [ -n "${POSTGRES_USER:-}" ]; then
    PREFECT_API_DATABASE_CONNECTION_URL=$(database_url postgresql+asyncpg prefect) || exit 2
    export PREFECT_API_DATABASE_CONNECTION_URL
fi
: "${PREFECT_API_DATABASE_CONNECTION_URL:?set it to the postgresql+asyncpg:// URL of the prefect database}"
export PREFECT_SERVER_ANALYTICS_ENABLED="${PREFECT_SERVER_ANALYTICS_ENABLED:-false}"
# Concurrency leases (the trainer slots) in files under PREFECT_HOME, a volume in compose:
# a restarted server still knows the open ones, and revokes those nobody renews any more
# (in memory, Prefect's default, a restart would leave their slots counted for ever).
export PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE="${PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE:-prefect.server.concurrency.lease_storage.filesystem}"
# Where the UI in the browser calls the API: this server, unless published elsewhere.
export PREFECT_UI_API_URL="${PREFECT_UI_API_URL:-http://${PREFECT_SERVER_API_HOST:-127.0.0.1}:${PREFECT_SERVER_API_PORT:-4200}/api}"
exec prefect server start \
    --host "${PREFECT_SERVER_API_HOST:-127.0.0.1}" \
    --port "${PREFECT_SERVER_API_PORT:-4200}"
