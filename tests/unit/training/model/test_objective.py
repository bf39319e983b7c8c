"""The loss over a batch's real rows: padding rows (label −1) weigh nothing."""

import torch
import torch.nn.functional as F

from ingestion.reader import PAD_LABEL, build_reader
from training.config import ModelConfig
from training.model.build import build_train_model
from training.model.objective import real_rows_log_loss


def test_the_loss_is_the_mean_over_real_rows_only() -> None:
    logits = torch.tensor([0.3, -1.2, 2.0, 5.0, -7.0], dtype=torch.float64)
    labels = torch.tensor([1.0, 0.0, 1.0, PAD_LABEL, PAD_LABEL], dtype=torch.float64)
    expected = F.binary_cross_entropy_with_logits(logits[:3], labels[:3])
    assert torch.allclose(real_rows_log_loss(logits, labels), expected.float())
    assert real_rows_log_loss(logits[3:], labels[3:]) == 0.0, "an all-padding batch has no loss"


def test_padding_rows_leave_every_gradient_as_the_real_rows_alone_give_it(tiny_features) -> None:
    state, files = tiny_features
    torch.manual_seed(0)
    model = build_train_model(ModelConfig(embedding_dim=8, bottom_mlp=(32, 8), top_mlp=(32, 1)), state.table_sizes,
                              torch.device("cpu"))  # fmt: skip
    reader = build_reader(files[2], 64, drop_remainder=False)
    *_, last = iter(reader)  # the day's tail, padded to 64 rows
    real = int((last.labels != PAD_LABEL).sum())
    assert 0 < real < 64, "the fixture's last batch is a partial one"
    grads = []
    for batch in (last, _first_rows(last, real)):
        model.zero_grad()
        loss, _ = model(batch)
        loss.backward()
        grads.append({n: p.grad.to_dense().clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, grad in grads[0].items():
        assert torch.allclose(grad, grads[1][name], atol=1e-6), name


def _first_rows(batch, n: int):
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kjt = batch.sparse_features
    values = kjt.values().view(len(kjt.keys()), -1)[:, :n].reshape(-1)
    lengths = kjt.lengths().view(len(kjt.keys()), -1)[:, :n].reshape(-1)
    return Batch(batch.dense_features[:n], KeyedJaggedTensor(kjt.keys(), values, lengths=lengths), batch.labels[:n])
