#!/bin/sh
# The MLflow tracking server, as the mlflow service runs it (and the tests, natively):
# PostgreSQL backend store, artifacts served by the server itself from a local folder.
#   MLFLOW_BACKEND_STORE_URI      postgresql://user:password@host:5432/mlflow
#   MLFLOW_ARTIFACTS_DESTINATION  folder (a volume in compose) or an object-store URL
#   MLFLOW_HOST / MLFLOW_PORT     where to listen (default 127.0.0.1:5000)
#   MLFLOW_ALLOWED_HOSTS          Host headers the server answers, with their ports (a guard
#                                 against DNS rebinding); default: this loopback port
#   or POSTGRES_USER, POSTGRES_PASSWORD [, POSTGRES_HOST]: the store URL is built from them, encoded
#   MLFLOW_SERVER_ENABLE_JOB_EXECUTION  default false here: MLflow's job runner (its GenAI
#                                 evaluation and prompt jobs; 8 processes, about 4 s of CPU a
#                                 start) serves nothing this project logs; true brings it back
set -eu
MLFLOW_SERVER_ENABLE_JOB_EXECUTION=${MLFLOW_SERVER_ENABLE_JOB_EXECUTION:-false}
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION
. "$(dirname "$0")/database-url.sh"
if [ -z "${MLFLOW_BACKEND_STORE_URI:-}" ] && [ -n "${POSTGRES_USER:-}" ]; then
    MLFLOW_BACKEND_STORE_URI=$(database_url postgresql mlflow) || exit 2
    export MLFLOW_BACKEND_STORE_URI
fi
: "${MLFLOW_BACKEND_STORE_URI:?set it to the postgresql:// URL of the mlflow database}"
: "${MLFLOW_ARTIFACTS_DESTINATION:?set it to the folder or URL that keeps the artifacts}"
exec mlflow server \
    --backend-store-uri "$MLFLOW_BACKEND_STORE_URI" \
    --serve-artifacts \
    --artifacts-destination "$MLFLOW_ARTIFACTS_DESTINATION" \
    --host "${MLFLOW_HOST:-127.0.0.1}" \
    --port "${MLFLOW_PORT:-5000}" \
    --allowed-hosts "${MLFLOW_ALLOWED_HOSTS:-localhost:${MLFLOW_PORT:-5000},127.0.0.1:${MLFLOW_PORT:-5000}}" \
    --workers "${MLFLOW_WORKERS:-2}"
