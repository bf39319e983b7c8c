"""Prefect settings the `dlrm` command and the tests share; set before Prefect is imported
(Prefect reads its settings once). A value already in the environment wins."""

from __future__ import annotations

import logging
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


def quiet_library_output() -> None:
    """Settings that keep a normal run's console to what a person needs: no MLflow download
    progress bars (a champion's files are a few MB, fetched in a blink) or notes on creating
    its database, and not torch.fx's notice (torchrec asks whether it is being traced, which
    it never is here)."""
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    logging.getLogger("torch.fx._symbolic_trace").addFilter(lambda record: "is_fx_tracing" not in record.getMessage())


class WithoutTracebacksOf(logging.Filter):
    """Drops the console records of Prefect's flow and task runs that carry a traceback of
    an error the command reports itself in one line (a bad config, a bad file): the person
    reads that line, and the Prefect UI still has the traceback."""

    def __init__(self, error_names: set[str]) -> None:
        super().__init__()
        self.error_names = error_names

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        names = {cls.__name__ for cls in type(error).__mro__} if error is not None else set()
        return not names & self.error_names


def console_without_tracebacks_of(error_names: set[str]) -> None:
    """Install `WithoutTracebacksOf` on Prefect's console handler (after Prefect set up its logging)."""
    from prefect.logging.handlers import PrefectConsoleHandler

    for handler in [*logging.getLogger().handlers, *logging.getLogger("prefect").handlers]:
        if isinstance(handler, PrefectConsoleHandler) and not any(
            isinstance(f, WithoutTracebacksOf) for f in handler.filters
        ):
            handler.addFilter(WithoutTracebacksOf(error_names))
