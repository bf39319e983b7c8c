import pytest
import torch

from ingestion.reader import build_reader
from training.config import ModelConfig
from training.model import (
    build_dlrm,
    build_train_model,
    embedding_tables,
    training_flops_per_sample,
)


@pytest.mark.parametrize("arch", ["dlrm", "dlrm_dcn"])
def test_model_scores_a_reader_batch(tiny_features, arch: str) -> None:
    state, files = tiny_features
    config = ModelConfig(arch=arch, embedding_dim=8, bottom_mlp=(32, 8), top_mlp=(32, 1), dcn_low_rank_dim=4)
    model = build_dlrm(config, state.table_sizes, torch.device("cpu"))
    batch = next(iter(build_reader(files[2], 64)))
    logits = model(batch.dense_features, batch.sparse_features)
    assert logits.shape == (64, 1) and torch.isfinite(logits).all()


def test_tables_follow_the_preprocessing_state(tiny_features) -> None:
    state, _ = tiny_features
    tables = embedding_tables(ModelConfig(embedding_dim=8, bottom_mlp=(8,)), state.table_sizes)
    assert [(t.feature_names[0], t.num_embeddings, t.embedding_dim) for t in tables] == [
        (name, rows, 8) for name, rows in state.table_sizes.items()
    ]


def test_meta_model_allocates_nothing(tiny_features) -> None:
    state, _ = tiny_features
    model = build_train_model(ModelConfig(), state.table_sizes, torch.device("meta"))
    assert all(p.is_meta for p in model.parameters())


def test_training_flops_grow_with_the_mlps() -> None:
    small = training_flops_per_sample(ModelConfig(embedding_dim=16, bottom_mlp=(64, 16), top_mlp=(64, 1)), 26)
    large = training_flops_per_sample(ModelConfig(), 26)
    # multiply-adds forward: bottom 13·512 + 512·256 + 256·16 = 141,824; dot interaction of
    # 27 vectors 27·27·16 = 11,664; top (16 + 351)·512 + 512·256 + 256·1 = 319,232.
    # FLOPs = 2 per multiply-add, training ≈ 3 × forward.
    assert large == 3 * 2 * (141_824 + 11_664 + 319_232)
    assert small < large
