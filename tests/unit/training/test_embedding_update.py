"""Choosing the embeddings' CPU update kernel by timing both (training/embedding_update.py)."""

from __future__ import annotations

import pytest

from training import cpu_rowwise_adagrad, embedding_update


def test_the_probe_times_both_kernels_and_leaves_fbgemms_installed() -> None:
    cpu_rowwise_adagrad.install()
    times = embedding_update.probe_ms(embedding_dim=8, batch=64, turns=1, steps=1)
    assert set(times) == {"fbgemm", "vectorized"}
    assert all(0 < t < 10_000 for t in times.values())
    assert not cpu_rowwise_adagrad.installed()


@pytest.mark.parametrize(
    ("fbgemm", "vectorized", "expected"),
    [
        (2.0, 1.0, "vectorized"),
        (1.0, 2.0, "fbgemm"),
        (1.0, 0.95, "fbgemm"),
        (1.0, 0.89, "vectorized"),
    ],
)
def test_the_vectorized_kernel_replaces_fbgemms_only_when_clearly_faster(fbgemm: float, vectorized: float,
                                                                         expected: str) -> None:  # fmt: skip
    assert embedding_update.faster({"fbgemm": fbgemm, "vectorized": vectorized}) == expected


def test_use_switches_the_installed_kernel() -> None:
    embedding_update.use("vectorized")
    assert cpu_rowwise_adagrad.installed()
    embedding_update.use("fbgemm")
    assert not cpu_rowwise_adagrad.installed()


def test_only_fbgemms_kernel_is_timed_and_kept_when_its_op_changed_its_arguments(monkeypatch) -> None:
    """Mocks fbgemm's op schema (a newer fbgemm's) to differ from the vectorised kernel's."""
    monkeypatch.setattr(cpu_rowwise_adagrad, "schema_arguments", lambda: ["grad_output", "a_new_argument"])
    assert not cpu_rowwise_adagrad.fits_this_fbgemm()
    times = embedding_update.probe_ms(embedding_dim=8, batch=64, turns=1, steps=1)
    assert list(times) == ["fbgemm"] and embedding_update.faster(times) == "fbgemm"
