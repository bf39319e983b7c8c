"""This project's CPU row-wise Adagrad kernels (vectorised torch ops, and the native C loop)
against fbgemm's own kernel and a float64 oracle, through fbgemm's real table-batched
embedding module (forward, backward, fused update)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
    ComputeDevice,
    EmbeddingLocation,
    PoolingMode,
)
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    SplitTableBatchedEmbeddingBagsCodegen,
    WeightDecayMode,
)

from training.cpu import embedding_update
from training.cpu import rowwise_adagrad as cpu_rowwise_adagrad
from training.cpu.rowwise_adagrad import FbgemmArgs

LR, EPS = 0.05, 1e-6


@dataclass(frozen=True)
class Case:
    tables: tuple[tuple[int, int], ...]  # (rows, dim)
    feature_table_map: tuple[int, ...]
    max_bag: int  # bag lengths drawn from 0..max_bag (1: one id per bag)
    pooling: PoolingMode = PoolingMode.SUM
    weighted: bool = False
    weight_decay: float = 0.0  # fbgemm's L2 mode when set


CASES = {
    "one_id_per_bag": Case(((50, 16), (7, 16), (300, 16)), (0, 1, 2), max_bag=1),
    "multi_hot_sum": Case(((40, 8), (9, 8)), (0, 1), max_bag=4),
    "multi_hot_mean": Case(((40, 8), (9, 8)), (0, 1), max_bag=4, pooling=PoolingMode.MEAN),
    "per_id_weights": Case(((40, 8), (9, 8)), (0, 1), max_bag=3, weighted=True),
    "mixed_dims": Case(((30, 4), (20, 16), (25, 8)), (0, 1, 2), max_bag=2),
    "shared_table": Case(((30, 8), (12, 8)), (0, 0, 1), max_bag=2),
    "l2_decay": Case(((40, 8), (9, 8)), (0, 1), max_bag=2, weight_decay=0.3),
    "l2_decay_one_id_per_bag": Case(((50, 16), (7, 16)), (0, 1), max_bag=1, weight_decay=0.3),
}
BATCH, STEPS = 6, 3


def _module(case: Case) -> SplitTableBatchedEmbeddingBagsCodegen:
    torch.manual_seed(0)
    module = SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for rows, dim in case.tables],
        feature_table_map=list(case.feature_table_map),
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=LR,
        eps=EPS,
        pooling_mode=case.pooling,
        weight_decay=case.weight_decay,
        weight_decay_mode=WeightDecayMode.L2 if case.weight_decay else WeightDecayMode.NONE,
    )
    module.init_embedding_weights_uniform(-0.5, 0.5)
    return module


def _batches(case: Case) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]]:
    """(ids, offsets, per-id weights, output gradient) per step; ids repeat within a batch."""
    generator = torch.Generator().manual_seed(1)
    width = sum(case.tables[t][1] for t in case.feature_table_map)
    batches = []
    for _ in range(STEPS):
        low = 1 if case.max_bag == 1 else 0
        lengths = torch.randint(low, case.max_bag + 1, (len(case.feature_table_map) * BATCH,), generator=generator)
        ids = torch.cat([
            torch.randint(0, max(2, case.tables[t][0] // 3), (int(lengths[f * BATCH:(f + 1) * BATCH].sum()),),
                          generator=generator)
            for f, t in enumerate(case.feature_table_map)
        ])  # fmt: skip
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        weights = torch.rand(ids.numel(), generator=generator) + 0.5 if case.weighted else None
        batches.append((ids, offsets, weights, torch.randn(BATCH, width, generator=generator)))
    return batches


def _train(case: Case) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    module = _module(case)
    for ids, offsets, weights, grad in _batches(case):
        module(ids, offsets, per_sample_weights=weights).backward(grad)
    return ([w.detach().clone() for w in module.split_embedding_weights()],
            [s[0].detach().clone().reshape(-1) for s in module.split_optimizer_states()])  # fmt: skip


def _oracle(case: Case) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Exact row-wise Adagrad in float64, bag by bag, from the module's initial weights."""
    weights = [w.double().numpy().copy() for w in _module(case).split_embedding_weights()]
    moments = [np.zeros(rows) for rows, _ in case.tables]
    starts = np.cumsum([0] + [case.tables[t][1] for t in case.feature_table_map])
    for ids, offsets, id_weights, grad in _batches(case):
        summed: dict[tuple[int, int], np.ndarray] = {}
        for f, t in enumerate(case.feature_table_map):
            for b in range(BATCH):
                lo, hi = int(offsets[f * BATCH + b]), int(offsets[f * BATCH + b + 1])
                g = grad[b, starts[f]:starts[f + 1]].double().numpy()
                for i in range(lo, hi):
                    factor = 1.0 / (hi - lo) if case.pooling == PoolingMode.MEAN else 1.0
                    factor *= float(id_weights[i]) if id_weights is not None else 1.0
                    key = (t, int(ids[i]))
                    summed[key] = summed.get(key, 0.0) + factor * g
        for (t, row), g in summed.items():
            g = g + case.weight_decay * weights[t][row]
            moments[t][row] += np.mean(g * g)
            weights[t][row] -= LR * g / (np.sqrt(moments[t][row]) + EPS)
    return weights, moments


@pytest.fixture
def vectorised():
    embedding_update.use("vectorized")
    yield
    embedding_update.use("fbgemm")


@pytest.mark.parametrize("kernel", ["vectorized", "native"])
@pytest.mark.parametrize("name", CASES)
def test_matches_fbgemms_kernel_and_a_float64_oracle(name: str, kernel: str) -> None:
    case = CASES[name]
    embedding_update.use(kernel)
    try:
        assert embedding_update.installed() == kernel
        ours = _train(case)
    finally:
        embedding_update.use("fbgemm")
    oracle = _oracle(case)
    # fbgemm's CPU kernel ignores weight decay (see the test below): the oracle alone judges it
    fbgemm = _train(case) if not case.weight_decay else ours
    for mine, theirs, exact in zip(ours[0] + ours[1], fbgemm[0] + fbgemm[1], oracle[0] + oracle[1], strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(mine.double().numpy(), exact, rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(w, w0) for w, w0 in zip(ours[0], _module(case).split_embedding_weights(), strict=True))


def test_fbgemms_cpu_kernel_ignores_embedding_weight_decay() -> None:
    """Why `auto` never leaves an L2-decayed run to fbgemm on CPU: its CPU kernel trains as if
    no decay were set (its CUDA kernel applies it, as the oracle does)."""
    decayed = CASES["l2_decay"]
    plain = Case(decayed.tables, decayed.feature_table_map, decayed.max_bag)
    fbgemm, undecayed, oracle = _train(decayed), _oracle(plain), _oracle(decayed)
    for theirs, exact, decay_applied in zip(fbgemm[0], undecayed[0], oracle[0], strict=True):
        np.testing.assert_allclose(theirs.double().numpy(), exact, rtol=1e-5, atol=1e-6)
        assert np.abs(exact - decay_applied).max() > 1e-3


def test_large_key_spaces_sort_instead_of_a_scratch_array(monkeypatch, vectorised) -> None:
    monkeypatch.setattr(cpu_rowwise_adagrad, "SCRATCH_MAX_ROWS", 0)
    case = CASES["multi_hot_sum"]
    sorted_path = _train(case)
    monkeypatch.undo()
    scratch_path = _train(case)
    for a, b in zip(sorted_path[0] + sorted_path[1], scratch_path[0] + scratch_path[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_fbgemms_own_kernel_comes_back(monkeypatch) -> None:
    case = CASES["one_id_per_bag"]
    calls = []
    original = embedding_update.KERNELS["vectorized"]
    monkeypatch.setitem(embedding_update.KERNELS, "vectorized", lambda args: calls.append(1) or original(args))
    embedding_update.use("vectorized")
    _train(case)
    assert len(calls) == STEPS and embedding_update.installed() == "vectorized"
    embedding_update.use("fbgemm")
    _train(case)
    assert len(calls) == STEPS and embedding_update.installed() == "fbgemm"


def test_unsupported_settings_name_the_fix(vectorised) -> None:
    torch.manual_seed(0)
    module = SplitTableBatchedEmbeddingBagsCodegen(
        [(10, 8, EmbeddingLocation.HOST, ComputeDevice.CPU)], optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=LR, weight_decay=0.1, weight_decay_mode=WeightDecayMode.DECOUPLE,
    )  # fmt: skip
    out = module(torch.tensor([1, 2]), torch.tensor([0, 1, 2]))
    with pytest.raises(NotImplementedError, match="cpu.embedding_update = 'fbgemm'"):
        out.backward(torch.ones_like(out))


def test_the_kernels_take_the_arguments_of_the_installed_fbgemms_op() -> None:
    assert embedding_update.schema_arguments() == list(FbgemmArgs._fields)
    assert embedding_update.fits_this_fbgemm()


def test_installing_one_kernel_replaces_the_other() -> None:
    try:
        embedding_update.use("vectorized")
        embedding_update.use("native")
        assert embedding_update.installed() == "native"
        case = CASES["one_id_per_bag"]
        native = _train(case)
        embedding_update.use("vectorized")
        vectorized = _train(case)
    finally:
        embedding_update.use("fbgemm")
    for a, b in zip(native[0] + native[1], vectorized[0] + vectorized[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_native_kernel_over_large_tables_and_repeated_ids() -> None:
    """A batch of the throughput benchmark's shape with ids far apart in big tables, many
    repeated: the hash table, the feature-major gradient and the prefetch against fbgemm."""
    tables, batch = 4, 512
    generator = torch.Generator().manual_seed(2)
    ids = torch.cat([torch.randint(0, 200_000, (batch // 2,), generator=generator).repeat(2) for _ in range(tables)])
    offsets = torch.arange(ids.numel() + 1)
    grad = torch.randn(batch, tables * 16, generator=generator)
    results = []
    for kernel in ("native", None):
        torch.manual_seed(0)
        module = SplitTableBatchedEmbeddingBagsCodegen(
            [(200_000, 16, EmbeddingLocation.HOST, ComputeDevice.CPU)] * tables,
            optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=LR, eps=EPS,
        )  # fmt: skip
        if kernel:
            embedding_update.use(kernel)
        try:
            for _ in range(2):
                module(ids, offsets).backward(grad)
        finally:
            embedding_update.use("fbgemm")
        results.append([w.detach().clone() for w in module.split_embedding_weights()] + [module.momentum1_host.clone()])
    for ours, fbgemms in zip(*results, strict=True):
        torch.testing.assert_close(ours, fbgemms, rtol=1e-6, atol=1e-6)


def test_a_changed_fbgemm_op_is_refused_with_the_fix_mocked_schema(monkeypatch) -> None:
    embedding_update.use("fbgemm")
    monkeypatch.setattr(embedding_update, "schema_arguments", lambda: ["grad_output", "something_new"])
    with pytest.raises(RuntimeError, match=r"changed the arguments.*cpu.embedding_update = 'fbgemm'"):
        embedding_update.use("vectorized")
    assert embedding_update.installed() == "fbgemm"
    assert embedding_update.choose("auto") == "fbgemm", "auto keeps fbgemm's own when its op changed"


@pytest.mark.parametrize("scratch", [True, False], ids=["scratch", "sort"])
def test_distinct_rows_are_numbered_by_first_occurrence(monkeypatch, scratch: bool) -> None:
    """Slots follow first occurrences on every run, whichever thread writes first."""
    if not scratch:
        monkeypatch.setattr(cpu_rowwise_adagrad, "SCRATCH_MAX_ROWS", 0)
    keys = torch.randint(0, 500, (50_000,), generator=torch.Generator().manual_seed(0))
    slots, first = cpu_rowwise_adagrad._distinct(keys, 1000)
    _, expected_first = np.unique(keys.numpy(), return_index=True)
    expected_first.sort()
    assert first.tolist() == expected_first.tolist()
    assert torch.equal(keys.index_select(0, first.index_select(0, slots)), keys), "each id's slot holds its key"
    assert torch.equal(slots[first], torch.arange(first.numel())), "slot k is the k-th key to appear"
