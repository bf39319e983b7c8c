#!/bin/sh
# The trainer's entrypoint: the Optuna storage and the promotion lock URLs from the
# database credentials (URL-encoded, the example password refused), then the command.
#   POSTGRES_USER, POSTGRES_PASSWORD, POSTGRES_HOST (default postgres:5432)
set -eu
. "$(dirname "$0")/database-url.sh"
if [ -z "${OPTUNA_STORAGE:-}" ]; then
    OPTUNA_STORAGE=$(database_url postgresql optuna) || exit 2
    export OPTUNA_STORAGE
fi
export DLRM_LOCK_URL="${DLRM_LOCK_URL:-$OPTUNA_STORAGE}"
exec "$@"
