"""Integration fixtures: one temporary Prefect server for the whole session."""

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def prefect_server() -> Iterator[str]:
    """The session's temporary Prefect server; yields its API URL, for `dlrm` subprocesses
    (each would otherwise start a temporary server of its own: ~15 s)."""
    import prefect.settings
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield prefect.settings.PREFECT_API_URL.value()
