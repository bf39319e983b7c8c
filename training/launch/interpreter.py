"""What this project changes about a Python process's start and end.

**The start: imports without the cyclic garbage collector.** Importing torch, TorchRec,
Prefect and MLflow builds about 600,000 objects in a `dlrm run` (340,000 in a training
rank). While they are being built, the collector's full passes run about ten times, each
over everything built so far. Those objects live as long as the process, so the collector
is paused while they are imported and then told to leave them out of every later pass
(`gc.freeze`): 0.8 s of a rank's 3.9 s start, 1.1 s of the temporary Prefect server's 3.8 s
(bench/start_up.py; docs/performance.md). A process that forks workers after its imports
(the warm ranks) gains twice: a child's collections no longer walk, and so copy, the pages
its parent's objects sit on.

**The end: the exit work without the teardown.** At a normal exit the interpreter waits for
its threads, runs the exit handlers, then frees every object one by one: 2.3 s after a
`dlrm run` printed its report. A command ends with `end_without_teardown`, which does the
first two (the logs and events still queued are sent, files are flushed) and leaves the
freeing to the operating system.

Only the standard library here: every entry point imports this first.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import os
import sys
import threading
from collections.abc import Iterator
from typing import NoReturn


@contextlib.contextmanager
def imports_without_collection() -> Iterator[None]:
    """Run the block (a process's start-up imports) with the collector paused, then keep what
    it built out of the collector's passes. Nested blocks resume collection only at the end
    of the outermost; an exception in the block resumes it too."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        _unfreeze_at_exit()
        if was_enabled:
            gc.enable()


# Bindings (nanobind) that list the objects still alive when the interpreter ends, on stderr
LEAK_CHECKING_BINDINGS = ("duckdb",)


@functools.cache
def _unfreeze_at_exit() -> None:
    atexit.register(_unfreeze_for_leak_checks)


def _unfreeze_for_leak_checks() -> None:
    """A process that ends with the interpreter's teardown frees its objects there, but not
    the frozen ones: DuckDB's bindings then find theirs still alive and print a leak report
    on stderr. Where DuckDB is loaded, the frozen objects go back to the collector first."""
    if any(name in sys.modules for name in LEAK_CHECKING_BINDINGS):
        gc.unfreeze()


def end_without_teardown(code: int) -> NoReturn:
    """End the process with `code` as a normal exit would, less the teardown: wait for the
    threads that are not daemons (after their own exit hooks, as Python does), run the exit
    handlers, flush the standard streams, then leave."""
    shutdown_threads = getattr(threading, "_shutdown", None)  # what Python's exit calls first
    if shutdown_threads is not None:
        shutdown_threads()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
