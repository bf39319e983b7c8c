"""`imports_without_collection`: the collector paused in the block, what the block built kept
out of later passes, and collection back on at the end of the outermost block, also when the
block fails."""

from __future__ import annotations

import gc

import pytest

from training.launch.start_up import imports_without_collection


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
