"""The pieces of a delta checkpoint that need no process group: row signatures, writing a
piece into a shard of another layout, and reading a chain."""

import json
from pathlib import Path

import pytest
import torch

from training.loop.checkpoint_chain import BrokenChain, chain_of
from training.loop.delta_checkpoint import (
    RowPiece,
    _write_piece,
    flat_leaves,
    put_back,
    row_signatures,
    without,
)


def test_a_one_column_leaf_gets_a_distinct_signature_for_every_distinct_value() -> None:
    values = torch.randn(50_000)
    values[1] = values[0] + 0.0  # equal values, equal signatures
    signatures = row_signatures(values)
    assert signatures[0] == signatures[1]
    assert len(torch.unique(signatures)) == len(torch.unique(values))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_change_in_any_one_column_of_a_row_changes_only_that_rows_signature(dtype: torch.dtype) -> None:
    table = torch.randn(300, 16).to(dtype)
    before = row_signatures(table)
    changed = table.clone()
    bits = changed.view(torch.int32 if dtype == torch.float32 else torch.int16)  # the same storage
    for row in range(300):
        bits[row, row % 16] += 1  # the next float away from zero: the smallest change this dtype can hold
    after = row_signatures(changed)
    assert bool((after != before).all())
    changed[5] = table[5]
    assert row_signatures(changed)[5] == before[5]


def test_signatures_are_the_same_in_chunks_as_whole() -> None:
    table = torch.randn((1 << 16) + 7, 4)
    whole = row_signatures(table)
    assert torch.equal(whole[-7:], row_signatures(table[-7:]))
    assert torch.equal(whole[:3], row_signatures(table[:3]))


def test_a_row_written_by_one_layout_lands_in_the_shards_of_another() -> None:
    """Rows of a column-wise shard (columns 4–7) land in a row-wise shard (rows 10–19, every
    column) only where both cover them."""
    target = torch.zeros(10, 8)
    piece = RowPiece(rows=torch.tensor([3, 12, 19, 25]), offsets=(4,), values=torch.arange(16.0).reshape(4, 4) + 1)
    _write_piece(target, (10, 0), piece)
    assert torch.equal(target[2, 4:], piece.values[1]) and torch.equal(target[9, 4:], piece.values[2])
    assert target[:, :4].abs().sum() == 0 and target.abs().sum() == piece.values[1:3].sum()
    one_column = torch.zeros(5)
    _write_piece(one_column, (20,), RowPiece(torch.tensor([19, 21, 24, 25]), (), torch.tensor([1.0, 2.0, 3.0, 4.0])))
    assert one_column.tolist() == [0.0, 2.0, 0.0, 0.0, 3.0]


def test_the_dense_part_is_the_state_without_the_row_leaves_and_loads_back_in_place() -> None:
    table, weight = torch.zeros(3, 2), torch.zeros(2)
    state = {"model": {"t": table, "w": weight}, "optimizer": {"state": {"t": {"m": torch.zeros(3)}}, "lr": 0.1}}
    dense = without(state, {"model/t", "optimizer/state/t/m"})
    assert set(flat_leaves(dense)) == {"model/w", "optimizer/lr"} and dense["model"]["w"] is weight
    dense["optimizer"]["lr"] = 0.2  # what DCP does with a value it cannot load in place
    put_back(state, dense)
    assert state["optimizer"]["lr"] == 0.2 and state["model"]["t"] is table


def _link(folder: Path, name: str, parent: str | None, files: dict[str, bytes]) -> Path:
    link = folder / name
    link.mkdir(parents=True)
    for file, data in files.items():
        (link / file).write_bytes(data)
    meta = {"kind": "delta" if parent else "full", "files": {file: len(data) for file, data in files.items()}}
    (link / "meta.json").write_text(json.dumps({**meta, **({"parent": parent} if parent else {})}))
    return link


def test_a_chain_is_read_oldest_first_and_a_missing_or_cut_link_is_named(tmp_path: Path) -> None:
    base = _link(tmp_path / "lineage", "night-1", None, {"a.distcp": b"x" * 10})
    middle = _link(tmp_path / "run", "step-5", "../lineage/night-1", {"rows-rank-00000.pt": b"y" * 5})
    newest = _link(tmp_path / "run", "step-10", "step-5", {"rows-rank-00000.pt": b"z" * 5})
    assert chain_of(newest) == [base, middle, newest]
    (middle / "rows-rank-00000.pt").write_bytes(b"y" * 4)
    with pytest.raises(BrokenChain, match="step-5/rows-rank-00000.pt is missing or not the 5 bytes written"):
        chain_of(newest)
    (middle / "meta.json").unlink()
    with pytest.raises(BrokenChain, match="step-5 is missing or incomplete"):
        chain_of(newest)
