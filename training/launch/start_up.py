"""A process's start-up imports without the cyclic garbage collector.

Importing torch, TorchRec, Prefect and MLflow builds about 600,000 objects in a `dlrm run`
(340,000 in a training rank). While they are being built, the collector's full passes run
about ten times, each over everything built so far: 2.5 s of the 8.7 s it took a `dlrm run`
to import its pipeline and end, 1.1 s of a rank's 4.0 s (bench/start_up.py;
docs/performance.md). Those objects live as long as the process, so the collector is paused
while they are imported and then told to leave them out of every later pass (`gc.freeze`).
A process that forks workers after its imports (the warm ranks) gains twice: a child's
collections no longer walk, and so copy, the pages its parent's objects sit on.

Only the standard library here: every entry point imports this first.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import sys
from collections.abc import Iterator


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
    """Frozen objects are not freed at exit, which is most of what freezing saves a process
    that ends normally (about 2 s of a `dlrm` command's end). DuckDB's bindings then find
    theirs still alive and print a leak report: where DuckDB is loaded, the frozen objects
    go back to the collector for its last pass, which frees them as it would have."""
    if any(name in sys.modules for name in LEAK_CHECKING_BINDINGS):
        gc.unfreeze()
