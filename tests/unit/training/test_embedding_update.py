"""Choosing the embeddings' CPU update kernel by timing each (training/embedding_update.py)."""

from __future__ import annotations

import pytest

from training import cpu_rowwise_adagrad, embedding_update, native_build, native_rowwise_adagrad


def test_the_probe_times_every_kernel_and_leaves_fbgemms_installed() -> None:
    cpu_rowwise_adagrad.install()
    times = embedding_update.probe_ms(embedding_dim=8, batch=64, turns=1, steps=1)
    assert set(times) == {"fbgemm", "vectorized", "native"}
    assert all(0 < t < 10_000 for t in times.values())
    assert not cpu_rowwise_adagrad.installed()


@pytest.mark.parametrize(
    ("times", "expected"),
    [
        ({"fbgemm": 2.0, "vectorized": 1.0}, "vectorized"),
        ({"fbgemm": 1.0, "vectorized": 2.0}, "fbgemm"),
        ({"fbgemm": 1.0, "vectorized": 0.95}, "fbgemm"),
        ({"fbgemm": 1.0, "vectorized": 0.89}, "vectorized"),
        ({"fbgemm": 3.0, "vectorized": 2.0, "native": 1.0}, "native"),
        ({"fbgemm": 3.0, "vectorized": 1.0, "native": 2.0}, "vectorized"),
        ({"fbgemm": 1.0, "vectorized": 2.0, "native": 0.95}, "fbgemm"),
        ({"fbgemm": 1.0}, "fbgemm"),
    ],
)
def test_a_kernel_of_this_project_replaces_fbgemms_only_when_clearly_fastest(times: dict, expected: str) -> None:
    assert embedding_update.faster(times) == expected


def test_use_switches_the_installed_kernel() -> None:
    for kernel in ("vectorized", "native"):
        embedding_update.use(kernel)
        assert cpu_rowwise_adagrad.installed() == kernel
    embedding_update.use("fbgemm")
    assert not cpu_rowwise_adagrad.installed()


def test_only_fbgemms_kernel_is_timed_and_kept_when_its_op_changed_its_arguments(monkeypatch) -> None:
    """Mocks fbgemm's op schema (a newer fbgemm's) to differ from this project's kernels'."""
    monkeypatch.setattr(cpu_rowwise_adagrad, "schema_arguments", lambda: ["grad_output", "a_new_argument"])
    assert not cpu_rowwise_adagrad.fits_this_fbgemm()
    times = embedding_update.probe_ms(embedding_dim=8, batch=64, turns=1, steps=1)
    assert list(times) == ["fbgemm"] and embedding_update.faster(times) == "fbgemm"


def test_without_a_c_compiler_the_native_kernel_is_left_out_and_refused_by_name(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("DLRM_NATIVE_CACHE", str(tmp_path / "cache"))  # nothing built there yet
    native_build.load.cache_clear()
    native_rowwise_adagrad.kernel.cache_clear()
    try:
        assert embedding_update.available() == ("fbgemm", "vectorized")
        with pytest.raises(RuntimeError, match="'native': no C compiler.*set training.cpu_embedding_update = 'vectorized'"):
            embedding_update.use("native")
        assert not cpu_rowwise_adagrad.installed()
    finally:
        native_build.load.cache_clear()
        native_rowwise_adagrad.kernel.cache_clear()
