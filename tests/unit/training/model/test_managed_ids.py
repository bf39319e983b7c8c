"""Managed-collision ids (training/model/managed_ids.py): admission and eviction against
hand-computed rounds, the state across a checkpoint, and serving's numpy remap."""

import numpy as np
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from training.model.managed_ids import STATE_BYTES_PER_ROW, ManagedIds


def ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def batch(**features: list[int]) -> KeyedJaggedTensor:
    values = [v for vs in features.values() for v in vs]
    lengths = [1] * len(values)
    return KeyedJaggedTensor.from_lengths_sync(list(features), ids(*values), torch.tensor(lengths))


def remapped(managed: ManagedIds, feature: str, values: list[int]) -> list[int]:
    return managed.remap(batch(**{feature: values})).values().tolist()


@pytest.mark.parametrize(("policy", "resident", "changed"), [
    # counts after round 2: 1 → 5, 2 → 3, 3 → 3, and newcomer 4 → 3: a tie keeps the residents
    ("lfu", {1, 2, 3}, []),
    # last seen: 1 and 3 in round 2, 2 in round 1: 2 is the stalest, 4 takes its row
    ("lru", {1, 3, 4}, ["row of 2"]),
    # uses / (rounds since seen + 1): 1 → 5, 2 → 3/2, 3 → 3, 4 → 3: 2 gives way
    ("distance_lfu", {1, 3, 4}, ["row of 2"]),
])  # fmt: skip
def test_each_policy_admits_and_evicts_as_computed_by_hand(policy: str, resident: set[int], changed: list) -> None:
    """A table of 4 rows holds 3 ids; row 3 is every other id's."""
    managed = ManagedIds({"f": 4}, policy)
    first = managed.admit({"f": ids(1, 1, 1, 1, 2, 2, 2, 3)})
    assert sorted(first["f"].tolist()) == [0, 1, 2], "three free rows taken"
    assert set(managed.id_rows("f")) == {1, 2, 3}
    rows_before = managed.id_rows("f")
    second = managed.admit({"f": ids(1, 3, 3, 4, 4, 4)})
    assert set(managed.id_rows("f")) == resident
    assert second["f"].tolist() == [rows_before[2] for _ in changed], "the evicted id's row starts afresh"
    if 4 in resident:
        assert managed.id_rows("f")[4] == rows_before[2]
    rows = managed.id_rows("f")
    assert remapped(managed, "f", [1, 2, 3, 4, 99]) == [rows.get(i, 3) for i in (1, 2, 3, 4, 99)]
    assert managed.miss_row("f") == 3


def test_ids_below_the_admission_count_share_the_miss_row_even_with_free_rows() -> None:
    managed = ManagedIds({"f": 8}, "lfu", admit_min_count=2)
    managed.admit({"f": ids(5, 6, 6, 7, 7, 7)})
    assert set(managed.id_rows("f")) == {6, 7}
    assert remapped(managed, "f", [5, 6, 7])[0] == 7, "5 was seen once: the miss row (7 of 8)"


def test_a_round_larger_than_the_first_admits_every_id() -> None:
    """TorchRec sizes its id history from the first round and drops what does not fit later;
    each round here is sized to its own ids."""
    managed = ManagedIds({"f": 64}, "lfu")
    managed.admit({"f": ids(1, 2)})
    managed.admit({"f": torch.arange(100, 150).repeat(3)})
    assert set(managed.id_rows("f")) == {1, 2, *range(100, 150)}


def test_recorded_ids_wait_for_the_round_and_remapping_does_not_admit() -> None:
    managed = ManagedIds({"a": 8, "b": 8}, "lfu")
    managed.record(batch(a=[1, 2], b=[9, 8]))
    managed.record(batch(a=[2], b=[9]))
    assert remapped(managed, "a", [1, 2]) == [7, 7], "nothing is admitted before a round"
    pending = managed.pending()
    assert pending["a"].tolist() == [1, 2, 2] and pending["b"].tolist() == [9, 8, 9]
    managed.admit(pending)
    assert set(managed.id_rows("a")) == {1, 2} and set(managed.id_rows("b")) == {8, 9}
    assert managed.pending()["a"].numel() == 0


def test_the_state_survives_a_checkpoint_and_replicas_fed_alike_stay_equal() -> None:
    """A copy loaded from the state dict remaps as the original and, given the same later
    rounds, stays equal to it: the remapping is the state dict's, whatever the process."""
    rng = np.random.default_rng(0)
    rounds = [torch.from_numpy(rng.zipf(1.3, 400).astype(np.int64) + 1000 * r) for r in range(4)]
    original = ManagedIds({"f": 32, "g": 16}, "distance_lfu")
    for round_ids in rounds[:2]:
        original.admit({"f": round_ids, "g": round_ids % 50})
    restored = ManagedIds({"f": 32, "g": 16}, "distance_lfu")
    restored.load_state_dict(original.state_dict())
    probe = list(range(0, 3000, 7))
    for feature in ("f", "g"):
        assert remapped(restored, feature, probe) == remapped(original, feature, probe)
    for round_ids in rounds[2:]:
        a = original.admit({"f": round_ids, "g": round_ids % 50})
        b = restored.admit({"f": round_ids, "g": round_ids % 50})
        assert all(torch.equal(a[f], b[f]) for f in a)
    for key, tensor in original.state_dict().items():
        assert torch.equal(tensor, restored.state_dict()[key]), key


def test_the_served_model_remaps_exactly_as_training() -> None:
    """The arrays the registered model carries (training/serving/export.py) and the pyfunc's
    lookup (numpy only) give every id the row training gives it, the last row to the others."""
    from training.serving.champion_pyfunc import FeatureMap
    from training.serving.export import managed_id_arrays

    managed = ManagedIds({"f": 16}, "lru")
    managed.admit({"f": ids(-5, 0, 3, 3, 2**62, 17)})
    managed.admit({"f": ids(40, 41, 42, 3)})
    served = FeatureMap({"mode": "managed", "buckets": {"f": 16}, "multi_hot": []}, managed_id_arrays(managed))
    probe = [-5, 0, 3, 2**62, 17, 40, 41, 42, 43, -(2**63), 2**63 - 2]
    assert served.rows("f", np.array(probe, dtype=np.int64)).tolist() == remapped(managed, "f", probe)
    assert managed.state_bytes() == 16 * STATE_BYTES_PER_ROW["lru"] + 8_208


def test_one_search_over_all_features_remaps_as_each_torchrec_module_does() -> None:
    """Tables of different sizes, bags of different lengths, keys in another order: the
    batched search gives what each feature's `MCHManagedCollisionModule.remap` gives."""
    rng = np.random.default_rng(3)
    managed = ManagedIds({"a": 8, "b": 50, "c": 3}, "lfu")
    managed.admit({f: torch.from_numpy(rng.integers(0, 80, 300)) for f in ("a", "b", "c")})
    lengths = torch.tensor([2, 0, 3, 1, 1, 1, 4, 0, 2], dtype=torch.int32)  # "c", "a", "b" × 3 examples
    values = torch.from_numpy(rng.integers(-5, 90, int(lengths.sum())))
    kjt = KeyedJaggedTensor.from_lengths_sync(["c", "a", "b"], values, lengths)
    expected = torch.cat([managed.tables[f].remap({f: jagged})[f].values() for f, jagged in kjt.to_dict().items()])
    remapped = managed.remap(kjt)
    assert torch.equal(remapped.values(), expected) and torch.equal(remapped.lengths(), kjt.lengths())


def test_ids_evicted_and_back_are_counted_and_a_churning_table_says_what_would_hold_them() -> None:
    """LRU over a table of 3 ids: ids 1–3, then 4–6 evict them, then 1–3 come back and evict
    4–6 again: 9 admissions, 3 of them ids evicted earlier; six distinct ids, 7 rows would hold them."""
    from training.model.managed_ids import churn_advice

    managed = ManagedIds({"f": 4, "g": 4}, "lru")
    for round_ids in ((1, 2, 3), (4, 5, 6), (1, 2, 3)):
        managed.admit({"f": ids(*round_ids), "g": ids(7)})
    churn = managed.churn["f"]
    assert (churn.admitted, churn.returned, churn.live_ids) == (9, 3, 6)
    assert (managed.churn["g"].admitted, managed.churn["g"].returned) == (1, 0)
    advice = churn_advice(managed.churn, {"f": 4, "g": 4})
    assert "3 of the 10 ids admitted (30%) had been evicted earlier" in advice
    assert "feature f: 6 distinct ids for 4 rows" in advice and "preprocess.hash_size = 7" in advice
    roomy = ManagedIds({"f": 8}, "lru")
    for round_ids in ((1, 2, 3), (4, 5, 6), (1, 2, 3)):
        roomy.admit({"f": ids(*round_ids)})
    assert roomy.churn["f"].returned == 0 and churn_advice(roomy.churn, {"f": 8}) == "", "room for all: no churn"
