"""The trained-rows fingerprint's per-row hash, against a pure-Python oracle."""

import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from training.loop.batches import row_hashes

GOLDEN = 0x9E3779B1


def oracle(ids_per_feature: list[list[list[int]]], labels: list[int]) -> list[int]:
    """Σ over features f and ids x of the row's bag: x · (f + 1) · GOLDEN; × 31 + label; mod 2⁶⁴."""
    hashes = []
    for row, label in enumerate(labels):
        total = sum(x * (f + 1) * GOLDEN for f, bags in enumerate(ids_per_feature) for x in bags[row])
        hashes.append((total * 31 + label) % 2**64)
    return hashes


def batch_of(ids_per_feature: list[list[list[int]]], labels: list[int]) -> Batch:
    keys = [f"C{f + 1}" for f in range(len(ids_per_feature))]
    lengths = [len(bag) for bags in ids_per_feature for bag in bags]  # feature-major
    values = [x for bags in ids_per_feature for bag in bags for x in bag]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.tensor(values, dtype=torch.int32), lengths=torch.tensor(lengths, dtype=torch.int32)
    )
    return Batch(dense_features=torch.zeros(len(labels), 13), sparse_features=kjt,
                 labels=torch.tensor(labels, dtype=torch.float32))  # fmt: skip


def as_unsigned(hashes: torch.Tensor) -> list[int]:
    return [h % 2**64 for h in hashes.tolist()]


def test_single_hot_rows_hash_as_the_oracle_says() -> None:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 2**31 - 1, (26, 64), generator=generator).tolist()
    features = [[[x] for x in row] for row in ids]
    labels = torch.randint(0, 2, (64,), generator=generator).tolist()
    assert as_unsigned(row_hashes(batch_of(features, labels))) == oracle(features, labels)


def test_multi_hot_and_missing_bags_hash_as_the_oracle_says() -> None:
    features = [[[5, 7], [], [2**31 - 2]], [[1], [3], [4]], [[], [9, 9, 9], [0]]]
    labels = [1, 0, 1]
    assert as_unsigned(row_hashes(batch_of(features, labels))) == oracle(features, labels)



def test_hashing_leaves_the_batch_as_it_was() -> None:
    """The ids are hashed where the model reads them (int64 on CPU is the batch's own tensor)."""
    features = [[[11], [12]], [[13], [14]]]
    batch = batch_of(features, [0, 1])
    kjt = batch.sparse_features
    batch.sparse_features = KeyedJaggedTensor.from_lengths_sync(keys=kjt.keys(), values=kjt.values().to(torch.int64),
                                                                lengths=kjt.lengths())  # fmt: skip
    before = batch.sparse_features.values().clone()
    row_hashes(batch)
    assert torch.equal(batch.sparse_features.values(), before)
