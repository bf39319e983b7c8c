"""`imports_without_collection`: the collector paused in the block, what the block built kept
out of later passes, and collection back on at the end of the outermost block, also when the
block fails. `end_without_teardown`: a normal exit's work, less the teardown."""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

import pytest

from training.launch.interpreter import imports_without_collection

ROOT = Path(__file__).resolve().parents[4]


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the cyclic collector frees it


def test_the_block_runs_without_collection_and_what_it_built_is_frozen() -> None:
    frozen_before = gc.get_freeze_count()
    assert gc.isenabled()
    with imports_without_collection():
        assert not gc.isenabled()
        kept = [Node() for _ in range(1000)]
    assert gc.isenabled()
    assert gc.get_freeze_count() >= frozen_before + len(kept), "the block's objects are left out of later passes"


def test_only_the_outermost_block_turns_collection_back_on() -> None:
    with imports_without_collection():
        with imports_without_collection():
            pass
        assert not gc.isenabled(), "an inner block does not resume collection inside the outer one"
    assert gc.isenabled()


def test_a_failing_block_still_turns_collection_back_on() -> None:
    with pytest.raises(ImportError), imports_without_collection():
        raise ImportError("no module named nowhere")
    assert gc.isenabled()


def test_a_process_that_had_collection_off_keeps_it_off() -> None:
    gc.disable()
    try:
        with imports_without_collection():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_an_end_without_teardown_still_does_a_normal_exits_work(tmp_path: Path) -> None:
    """The exit code given; a thread that is not a daemon finished first; the exit handlers
    run; buffered output written."""
    script = f"""
import atexit, sys, threading, time
from pathlib import Path
from training.launch.interpreter import end_without_teardown
folder = Path({str(tmp_path)!r})
def late():
    time.sleep(0.3)
    (folder / "thread").write_text("done")
threading.Thread(target=late).start()
atexit.register(lambda: (folder / "atexit").write_text("ran"))
sys.stdout.write("buffered, no newline")
end_without_teardown(3)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False,
                          cwd=ROOT)  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert done.stdout == "buffered, no newline"
    assert (tmp_path / "thread").read_text() == "done", "the thread was waited for"
    assert (tmp_path / "atexit").read_text() == "ran"
