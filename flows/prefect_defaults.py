"""Prefect settings the `dlrm` command and the tests share; set before Prefect is imported
(Prefect reads its settings once). A value already in the environment wins."""

from __future__ import annotations

import os

DASHBOARD_PORT = 4200  # Prefect's own default port for its server and UI
LOCAL_SERVER_DEFAULTS = {
    # The local server's usage telemetry needs the internet and only adds errors without it.
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    # The local server migrates a fresh database before it answers; Prefect waits 20 s for
    # it, which a busy 2-core machine overran (a demo and a test failed to start, then passed).
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
}


def apply_prefect_defaults() -> None:
    for name, value in LOCAL_SERVER_DEFAULTS.items():
        os.environ.setdefault(name, value)
