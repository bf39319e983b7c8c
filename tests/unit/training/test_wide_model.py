"""The wide DLRM (`model.wide`): a DLRM plus each id's own weight on the logit."""

import os
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ingestion.reader import build_reader
from training.config import ModelConfig, ShardingConfig
from training.model import build_dlrm, build_train_model, start_wide_at_zero
from training.stock_dlrm import WIDE_COLUMNS

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
    assert start_wide_at_zero(model) == sum(state.table_sizes.values()) * WIDE_COLUMNS + dense_inputs
    assert not model.dense_linear.weight.any()
    batch = next(iter(build_reader(files[2], 64)))
    assert np.abs(_wide_sums(model, batch)).max() == 0.0
    deep = [p[:, :8] for name, p in model.named_parameters() if "embedding_bags" in name]
    assert all(bool((d != 0).any()) for d in deep), "the deep columns keep their drawn values"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SHARDING_TYPES = ("table_wise", "column_wise", "data_parallel")


def _zero_sharded(rank: int, world: int, port: int, results) -> None:
    from training.sharding import shard_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        # One process group for every sharding type (row-wise needs CUDA; its shards hold
        # whole rows, like table-wise ones): 16 + 4 columns, which column-wise shards split.
        for sharding_type in SHARDING_TYPES:
            torch.manual_seed(0)
            config = ModelConfig(embedding_dim=16, bottom_mlp=(16,), top_mlp=(8, 1), wide=True)
            model = build_train_model(config, {"C1": 40, "C2": 7}, torch.device("meta"))
            kernel = "dense" if sharding_type == "data_parallel" else "fused"
            sharding = ShardingConfig(sharding_type=sharding_type, compute_kernel=kernel)
            sharded, _ = shard_model(model, sharding, torch.device("cpu"), 8)
            start_wide_at_zero(sharded)
            for name, weight in sharded.state_dict().items():
                if "embedding_bags" not in name:
                    continue
                if hasattr(weight, "local_shards"):  # a sharded table
                    full = torch.zeros(weight.size()) if rank == 0 else None
                    weight.gather(dst=0, out=full)
                else:  # a replicated one
                    full = weight.detach()
                if rank == 0:
                    results[(sharding_type, name)] = (bool((full[:, 16:] == 0).all()), bool((full[:, :16] != 0).all()))
    finally:
        dist.destroy_process_group()


def test_the_wide_columns_start_at_zero_on_every_shard() -> None:
    results = mp.Manager().dict()
    mp.spawn(_zero_sharded, args=(2, _free_port(), results), nprocs=2, join=True)
    assert {sharding_type for sharding_type, _ in dict(results)} == set(SHARDING_TYPES)
    assert len(results) == 2 * len(SHARDING_TYPES), dict(results)
    for name, (wide_zero, deep_drawn) in results.items():
        assert wide_zero and deep_drawn, (name, wide_zero, deep_drawn)


def test_the_served_model_rebuilds_the_wide_model_from_its_spec(tiny_features) -> None:
    """Serving rebuilds the model from the exported JSON spec and its state dict; a spec
    written before `wide` existed rebuilds the plain DLRM."""
    import json

    from torchrec.models.dlrm import DLRM

    from training.model import dlrm_spec
    from training.stock_dlrm import WideDLRM, build_stock_dlrm

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
