"""The dense part as CUDA graphs (training/model/cuda_graphs.py): which calls replay the graphs.

A CPU host cannot capture a CUDA graph, so these tests put a stand-in for
`torch.cuda.make_graphed_callables` in its place (named `mocked_capture`): it counts the calls
that would replay the graphs and computes them eagerly. What they check is the routing around
the graphs, which is this project's own: training steps at the captured batch replay them;
evaluation, other batches and no-grad calls run the DLRM's own modules; state dicts keep the
DLRM's names; the wide DLRM is not graphed; TorchRec's pipeline tracer sees one opaque call.
On a GPU, tests/integration/test_gpu.py trains with the real graphs.
"""

from __future__ import annotations

import pytest
import torch
from torchrec.distributed.train_pipeline.tracing import Tracer
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from training.config import ModelConfig
from training.model import cuda_graphs
from training.model.build import build_dlrm
from training.model.dot_interaction import swap_dot_interaction
from training.model.objective import RealRowsDLRMTrain

FEATURES = ["C1", "C2", "C3"]
BATCH = 16


class StandInReplay(torch.nn.Module):
    """What the capture returns, computed eagerly, counting its calls."""

    def __init__(self, head: torch.nn.Module) -> None:
        super().__init__()
        self.head, self.calls = head, 0

    def forward(self, dense: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.head(dense, embedded)


@pytest.fixture
def mocked_capture(monkeypatch: pytest.MonkeyPatch) -> list[StandInReplay]:
    captured: list[StandInReplay] = []

    def capture(head: torch.nn.Module, sample: tuple[torch.Tensor, ...]) -> StandInReplay:
        assert sample[0].shape == (BATCH, 13) and sample[1].shape == (BATCH, len(FEATURES), 8)
        assert sample[1].requires_grad, "the pooled embeddings' gradient is the graphs' output"
        captured.append(StandInReplay(head))
        return captured[-1]

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", capture)
    return captured


def _dlrm(wide: bool = False):
    torch.manual_seed(0)
    config = ModelConfig(embedding_dim=8, bottom_mlp=(16, 8), top_mlp=(16, 1), wide=wide)
    dlrm = build_dlrm(config, {f: 50 for f in FEATURES}, torch.device("cpu"))
    swap_dot_interaction(dlrm)
    return dlrm


def _inputs(batch: int) -> tuple[torch.Tensor, KeyedJaggedTensor]:
    ids = torch.randint(0, 50, (len(FEATURES) * batch,))
    lengths = torch.ones(len(FEATURES) * batch, dtype=torch.int32)
    return torch.rand(batch, 13), KeyedJaggedTensor(keys=FEATURES, values=ids, lengths=lengths, stride=batch)


def test_mocked_capture_training_steps_at_the_batch_replay_and_the_rest_runs_eagerly(mocked_capture) -> None:
    dlrm = _dlrm()
    names = list(dlrm.state_dict())
    dense, ids = _inputs(BATCH)
    eager = dlrm(dense, ids)
    assert cuda_graphs.graph_dense_parts(dlrm, BATCH, 13, 8, torch.device("cpu"), bf16=False) == 1
    [replay] = mocked_capture
    assert list(dlrm.state_dict()) == names, "no parameter of the graphs' own"

    dlrm.train()
    graphed = dlrm(dense, ids)
    assert replay.calls == 1 and torch.allclose(graphed, eager)
    graphed.sum().backward()
    assert all(p.grad is not None for p in dlrm.over_arch.parameters()), "gradients reach the top MLP"

    dlrm(*_inputs(BATCH // 2))  # another batch: eager
    with torch.no_grad():
        dlrm(dense, ids)  # no gradient wanted: eager
    dlrm.eval()
    assert torch.allclose(dlrm(dense, ids), eager)  # evaluation: eager, the same weights
    assert replay.calls == 1


def test_mocked_capture_leaves_the_wide_dlrm_as_it_is(mocked_capture) -> None:
    wide = _dlrm(wide=True)
    assert cuda_graphs.graph_dense_parts(wide, BATCH, 13, 8, torch.device("cpu"), bf16=False) == 0
    assert not mocked_capture


def test_mocked_capture_the_pipeline_tracer_records_the_dense_part_as_one_call(mocked_capture) -> None:
    """TorchRec's train pipeline traces the model to find its sharded modules' inputs; a shape
    test inside the traced forward would stop it (it cannot branch on a traced value)."""
    dlrm = _dlrm()
    cuda_graphs.graph_dense_parts(dlrm, BATCH, 13, 8, torch.device("cpu"), bf16=False)
    # traced from the training module, as the pipeline traces it (a root's own class forward
    # is traced, its submodules' forwards as called)
    graph = Tracer(leaf_modules=["model.sparse_arch"]).trace(RealRowsDLRMTrain(dlrm))
    called = [node.target for node in graph.nodes if node.op == "call_function"]
    assert cuda_graphs.dense_head in called
    assert [node.target for node in graph.nodes if node.op == "call_module"] == ["model.sparse_arch"]


def test_mocked_capture_a_graphed_model_built_again_lets_the_old_one_go(mocked_capture) -> None:
    """A retune's trials and in-process jobs build a model again and again: the process's table
    of graphed heads must not keep the old ones, their graphs and the graphs' memory alive."""
    import gc
    import weakref

    dlrm = _dlrm()
    cuda_graphs.graph_dense_parts(dlrm, BATCH, 13, 8, torch.device("cpu"), bf16=False)
    old_model, old_replay = weakref.ref(dlrm), weakref.ref(mocked_capture.pop())
    del dlrm
    gc.collect()
    assert old_model() is None and old_replay() is None

    again = _dlrm()
    cuda_graphs.graph_dense_parts(again, BATCH, 13, 8, torch.device("cpu"), bf16=False)
    again.train()
    dense, ids = _inputs(BATCH)
    again(dense, ids)
    assert mocked_capture[-1].calls == 1, "the new model replays its own graphs"
