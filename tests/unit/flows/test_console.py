"""What a person sees on the console: a failing run's one line without Prefect's traceback
of it before (the Prefect UI keeps it), and no library notices on a normal run."""

import logging
import sys

import pytest

from flows.cli.commands import USER_FACING_ERRORS
from flows.stages.prefect_defaults import (
    WithoutTracebacksOf,
    console_without_tracebacks_of,
    quiet_library_output,
)
from ingestion.warehouse import SourceReadError


def _record(error: BaseException | None) -> logging.LogRecord:
    exc_info = None
    if error is not None:
        try:
            raise error
        except BaseException:  # noqa: BLE001 - a record of whatever was raised
            exc_info = sys.exc_info()
    return logging.LogRecord("prefect.task_runs", logging.ERROR, __file__, 1, "Task run failed", None, exc_info)


def test_tracebacks_of_errors_the_command_reports_itself_are_left_out() -> None:
    quiet = WithoutTracebacksOf(USER_FACING_ERRORS)
    assert not quiet.filter(_record(SourceReadError("part-0.parquet: cannot read its Parquet footer")))
    assert quiet.filter(_record(RuntimeError("a fault of ours: its traceback is shown"))), "other errors keep theirs"
    assert quiet.filter(_record(None)), "records without a traceback stay"


def test_the_filter_sits_on_prefects_console_handler() -> None:
    from prefect.logging.handlers import PrefectConsoleHandler

    console = PrefectConsoleHandler()  # where Prefect's logging config puts it (root), set up here
    logging.getLogger().addHandler(console)
    try:
        console_without_tracebacks_of(USER_FACING_ERRORS)
        assert any(isinstance(f, WithoutTracebacksOf) for f in console.filters)
        assert not console.filter(_record(SourceReadError("bad file")))
    finally:
        logging.getLogger().removeHandler(console)


def test_torch_fx_notice_is_not_shown(caplog: pytest.LogCaptureFixture) -> None:
    quiet_library_output()
    fx = logging.getLogger("torch.fx._symbolic_trace")
    with caplog.at_level(logging.WARNING, logger="torch.fx._symbolic_trace"):
        fx.warning("is_fx_tracing will return true for both fx.symbolic_trace and torch.export")
        fx.warning("another notice")
    assert [r.getMessage() for r in caplog.records if r.name == fx.name] == ["another notice"]
