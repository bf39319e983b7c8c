"""A stage's threads are its own for as long as it runs, then the process's again."""

from __future__ import annotations

import pytest
import torch

from training.threads import intra_op_threads


def test_the_threads_are_set_for_the_block_and_given_back_after_it_even_on_an_error() -> None:
    before = torch.get_num_threads()
    other = 3 if before != 3 else 2
    with intra_op_threads(other):
        assert torch.get_num_threads() == other
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), intra_op_threads(other):
        raise RuntimeError("the stage failed")
    assert torch.get_num_threads() == before
