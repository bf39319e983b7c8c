"""The wide DLRM (`model.wide`): a DLRM plus each id's own weight on the logit."""

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from forked_ranks import start_ranks
from ports import free_port

from ingestion.reader import build_reader
from training.config import ModelConfig, ShardingConfig
from training.model.build import build_dlrm, build_train_model
from training.model.stock_dlrm import WIDE_COLUMNS
from training.sharding.start import WideStart, start_wide
from training.threads import intra_op_threads

WIDE = ModelConfig(embedding_dim=8, bottom_mlp=(16, 8), top_mlp=(16, 1), wide=True)


def _wide_sums(model: torch.nn.Module, batch) -> np.ndarray:
    """Σ over each row's ids of the sum of their wide columns, in float64 from the KJT's
    lengths and values (an independent reading of the inputs)."""
    kjt = batch.sparse_features
    weights = {name.split(".")[-2]: p.detach().double().numpy()
               for name, p in model.named_parameters() if "embedding_bags" in name}  # fmt: skip
    total = np.zeros(kjt.stride())
    for feature, jagged in kjt.to_dict().items():
        own = weights[f"t_{feature}"][:, -WIDE_COLUMNS:].sum(axis=1)
        lengths, values = jagged.lengths().numpy(), jagged.values().numpy()
        rows = np.repeat(np.arange(len(lengths)), lengths)
        total += np.bincount(rows, weights=own[values], minlength=len(lengths))
    return total


def test_the_wide_logit_is_the_dlrms_plus_each_ids_own_weight(tiny_features) -> None:
    """Its first `embedding_dim` columns make a plain DLRM (same weights), and the rest add
    the ids' own weights, beside a linear term of the dense features: no other path from
    the wide columns to the logit."""
    state, files = tiny_features
    torch.manual_seed(0)
    wide = build_dlrm(WIDE, state.table_sizes, torch.device("cpu"))
    plain = build_dlrm(ModelConfig(embedding_dim=8, bottom_mlp=(16, 8), top_mlp=(16, 1)), state.table_sizes,
                       torch.device("cpu"))  # fmt: skip
    weights = {name: value[:, :8] if "embedding_bags" in name else value for name, value in wide.state_dict().items()
               if not name.startswith("dense_linear")}  # fmt: skip
    plain.load_state_dict(weights)
    batch = next(iter(build_reader(files[2], 64)))
    with torch.no_grad():
        difference = wide(batch.dense_features, batch.sparse_features) - plain(batch.dense_features, batch.sparse_features)
    ids = _wide_sums(wide, batch)
    assert np.abs(ids).max() > 0.01, "the drawn wide columns add something"
    dense = batch.dense_features.double().numpy() @ wide.dense_linear.weight.detach().double().numpy().T
    expected = ids + dense[:, 0]
    np.testing.assert_allclose(difference.squeeze(1).double().numpy(), expected, atol=1e-5)


def test_tables_carry_the_wide_columns_and_only_the_dot_dlrm_has_them(tiny_features) -> None:
    state, _ = tiny_features
    model = build_train_model(WIDE, state.table_sizes, torch.device("meta"))
    widths = {p.shape[1] for name, p in model.named_parameters() if "embedding_bags" in name}
    assert widths == {8 + WIDE_COLUMNS}
    with pytest.raises(ValueError, match="wide"):
        ModelConfig(arch="dlrm_dcn", wide=True)


def test_a_fresh_wide_model_starts_as_its_dlrm(tiny_features) -> None:
    state, files = tiny_features
    torch.manual_seed(0)
    model = build_dlrm(WIDE, state.table_sizes, torch.device("cpu"))
    dense_inputs = model.dense_linear.in_features
    assert start_wide(model) == sum(state.table_sizes.values()) * WIDE_COLUMNS + dense_inputs
    assert not model.dense_linear.weight.any()
    batch = next(iter(build_reader(files[2], 64)))
    assert np.abs(_wide_sums(model, batch)).max() == 0.0
    deep = [p[:, :8] for name, p in model.named_parameters() if "embedding_bags" in name]
    assert all(bool((d != 0).any()) for d in deep), "the deep columns keep their drawn values"


SHARDING_TYPES = ("table_wise", "column_wise", "data_parallel")
TABLES = {"C1": 40, "C2": 7}
# known own weights, one per row, distinct everywhere: where a shard's rows or columns are
# misplaced, a row gets another row's weight
KNOWN_START = WideStart(
    id_weights={f"t_{feature}": torch.arange(rows, dtype=torch.float32) * 0.01 + k for k, (feature, rows)
                in enumerate(TABLES.items())},
    dense_weights=torch.arange(13, dtype=torch.float32) * 0.1 - 0.5,
    bias=-1.25,
)  # fmt: skip


def _gathered_tables(sharded: torch.nn.Module, rank: int) -> dict[str, torch.Tensor]:
    """Every table's full weights on rank 0 (sharded ones gathered, replicated ones as held)."""
    tables = {}
    for name, weight in sharded.state_dict().items():
        if "embedding_bags" not in name:
            continue
        if hasattr(weight, "local_shards"):  # a sharded table
            full = torch.zeros(weight.size()) if rank == 0 else None
            weight.gather(dst=0, out=full)
        else:  # a replicated one
            full = weight.detach().clone()
        tables[name.split(".")[-2]] = full
    return tables


def _start_sharded(rank: int, world: int, port: int, results) -> None:
    from training.sharding.plan import shard_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        # One process group for every sharding type (row-wise needs CUDA; its shards hold
        # whole rows, like table-wise ones): 16 + 4 columns, which column-wise shards split.
        for sharding_type in SHARDING_TYPES:
            torch.manual_seed(0)
            config = ModelConfig(embedding_dim=16, bottom_mlp=(16,), top_mlp=(8, 1), wide=True)
            model = build_train_model(config, TABLES, torch.device("meta"))
            kernel = "dense" if sharding_type == "data_parallel" else "fused"
            sharding = ShardingConfig(sharding_type=sharding_type, compute_kernel=kernel)
            sharded, _ = shard_model(model, sharding, torch.device("cpu"), 8)
            start_wide(sharded)
            zeroed = _gathered_tables(sharded, rank)
            start_wide(sharded, KNOWN_START)
            started = _gathered_tables(sharded, rank)
            if rank == 0:
                for table, full in zeroed.items():
                    own = KNOWN_START.id_weights[table].unsqueeze(1).expand(-1, WIDE_COLUMNS) / WIDE_COLUMNS
                    results[(sharding_type, table)] = (
                        bool((full[:, 16:] == 0).all()),
                        bool((full[:, :16] != 0).all()),
                        bool(torch.equal(started[table][:, 16:], own)),
                        bool(torch.equal(started[table][:, :16], full[:, :16])),
                    )
                params = dict(sharded.named_parameters())
                [linear] = [p for name, p in params.items() if name.endswith("dense_linear.weight")]
                last = [p for name, p in params.items() if "over_arch" in name]
                results[(sharding_type, "dense")] = (
                    bool(torch.equal(linear.detach()[0], KNOWN_START.dense_weights)),
                    bool((last[-2].detach() == 0).all()) and float(last[-1]) == KNOWN_START.bias,
                )
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # over 5 s: left out of `make test-fast`
def test_the_wide_columns_start_at_zero_or_at_given_weights_on_every_shard() -> None:
    """Own columns zeroed, then set to known weights; the deep columns keep their drawn
    values throughout; the dense linear term and the logit's bias follow the start."""
    results = mp.Manager().dict()
    start_ranks(_start_sharded, (2, free_port(), results), 2)
    results = dict(results)
    assert {sharding_type for sharding_type, _ in results} == set(SHARDING_TYPES)
    assert len(results) == (len(TABLES) + 1) * len(SHARDING_TYPES), results
    for key, checks in results.items():
        assert all(checks), (key, checks)


def test_a_wide_model_started_from_the_regression_scores_as_the_regression(tiny_features) -> None:
    """`model.wide_start = "logistic_regression"`: before any step, the model's logits are
    the fitted reference's, whatever its deep part holds."""
    from training.reference import fit_logistic_regression

    state, files = tiny_features
    fit = fit_logistic_regression(state.table_sizes, files[0], c_grid=(0.1,))
    torch.manual_seed(0)
    model = build_dlrm(WIDE, state.table_sizes, torch.device("cpu"))
    start_wide(model, WideStart.of_regression(fit.model))
    batch = next(iter(build_reader(files[2], 256)))
    with torch.no_grad():
        logits = model(batch.dense_features, batch.sparse_features).squeeze(1)
        reference = fit.model(batch.dense_features, batch.sparse_features)
    assert reference.std() > 0.1, "the reference has learned something to compare with"
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="wide_start"):
        ModelConfig(wide_start="logistic_regression")


def test_the_served_model_rebuilds_the_wide_model_from_its_spec(tiny_features) -> None:
    """Serving rebuilds the model from the exported JSON spec and its state dict; a spec
    written before `wide` existed rebuilds the plain DLRM."""
    import json

    from torchrec.models.dlrm import DLRM

    from training.model.build import dlrm_spec
    from training.model.stock_dlrm import WideDLRM, build_stock_dlrm

    state, files = tiny_features
    torch.manual_seed(0)
    trained = build_dlrm(WIDE, state.table_sizes, torch.device("cpu"))
    spec = json.loads(json.dumps(dlrm_spec(WIDE, state.table_sizes)))
    served = build_stock_dlrm(spec, torch.device("cpu"))
    served.load_state_dict(trained.state_dict())
    batch = next(iter(build_reader(files[2], 64)))
    with torch.no_grad():
        assert torch.equal(served(batch.dense_features, batch.sparse_features),
                           trained(batch.dense_features, batch.sparse_features))  # fmt: skip
    assert type(served) is WideDLRM
    del spec["wide"]
    assert type(build_stock_dlrm(spec, torch.device("meta"))) is DLRM


def _fetch_wide_start(rank: int, world: int, port: int, cache: str, jobs, results) -> None:
    from training.worker import _wide_start

    # a cache of its own (an earlier run's fit would be read back, not fitted), and the
    # threads the worker sets: the same rows on another number of threads sum in another order
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(world),
                      XDG_CACHE_HOME=cache)  # fmt: skip
    torch.set_num_threads(jobs["fresh"].training.threads_per_proc)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for label, job in jobs.items():
            results[(label, rank)] = _wide_start(job)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # over 5 s: left out of `make test-fast`
def test_every_rank_of_a_fresh_job_gets_the_references_fit_and_a_warm_start_none(tiny_features, tmp_path) -> None:
    """The worker fits the reference as the pipeline does (same rows, folds, sample; not
    salted by the job's seed), each feature with its own L2, on rank 0 and sends it to every
    rank; with `wide_start_l2 = "shared"`, the reference's own fit; a job that loads weights
    over it does not fit at all."""
    import dataclasses

    from evaluation.config import EvaluationConfig
    from training.config import TrainingConfig
    from training.job import TrainJob
    from training.reference import fit_logistic_regression

    state, files = tiny_features
    job = TrainJob(model=dataclasses.replace(WIDE, wide_start="logistic_regression"), sharding=ShardingConfig(),
                   training=TrainingConfig(seed=3), evaluation=EvaluationConfig(reference_max_rows=3000),
                   table_sizes=state.table_sizes, train_files=tuple(files[0] + files[1]), eval_files={},
                   out_dir=str(tmp_path / "train"), run_id="fresh")  # fmt: skip
    jobs = {"fresh": job, "warm": dataclasses.replace(job, init_checkpoint=str(tmp_path / "champion")),
            "zero": dataclasses.replace(job, model=WIDE),
            "shared": dataclasses.replace(job, model=dataclasses.replace(job.model, wide_start_l2="shared"))}  # fmt: skip
    results = mp.Manager().dict()
    start_ranks(_fetch_wide_start, (2, free_port(), str(tmp_path / "cache"), jobs, results), 2)
    # seed 0, whatever the job's; each feature's own L2, the default `model.wide_start_l2`
    with intra_op_threads(job.training.threads_per_proc):
        fit = fit_logistic_regression(state.table_sizes, job.train_files, max_rows=3000, per_feature_l2=True)
        shared = fit_logistic_regression(state.table_sizes, job.train_files, max_rows=3000)
    assert fit.train_rows < fit.rows_available, "the reference's row sample applies"
    assert fit.c_by_feature and not shared.c_by_feature
    for rank in (0, 1):
        for label, reference in (("fresh", fit), ("shared", shared)):
            got, expected = results[(label, rank)], WideStart.of_regression(reference.model)
            assert got.bias == expected.bias and torch.equal(got.dense_weights, expected.dense_weights)
            assert got.id_weights.keys() == expected.id_weights.keys()
            assert all(torch.equal(got.id_weights[t], expected.id_weights[t]) for t in expected.id_weights)
        assert results[("warm", rank)] is None and results[("zero", rank)] is None
