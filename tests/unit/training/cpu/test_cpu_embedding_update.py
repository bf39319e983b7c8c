"""Choosing the embeddings' CPU update kernel (training/cpu/embedding_update.py): by the
setting and what builds here, never by timing, so one job always computes one way."""

from __future__ import annotations

import pytest

from training.cpu import embedding_update, native_build, native_rowwise_adagrad


def test_auto_is_the_native_kernel_where_it_builds() -> None:
    assert embedding_update.choose("auto") == "native"
    for setting in ("native", "vectorized", "fbgemm"):
        assert embedding_update.choose(setting) == setting


def test_auto_decides_the_same_way_however_busy_the_machine_is_mocked_clock(monkeypatch) -> None:
    """The clock is mocked to jump by random amounts: a choice that timed anything would move."""
    import random
    import time

    jitter = random.Random(0)
    monkeypatch.setattr(time, "perf_counter", lambda: jitter.random() * 1e6)
    monkeypatch.setattr(time, "monotonic", lambda: jitter.random() * 1e6)
    assert {embedding_update.choose("auto") for _ in range(20)} == {"native"}


def test_use_switches_the_installed_kernel() -> None:
    for kernel in ("vectorized", "native", "vectorized"):
        embedding_update.use(kernel)
        assert embedding_update.installed() == kernel
    embedding_update.use("fbgemm")
    assert embedding_update.installed() == "fbgemm"


def test_without_a_c_compiler_auto_keeps_fbgemms_and_native_is_refused_by_name(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("DLRM_NATIVE_CACHE", str(tmp_path / "cache"))  # nothing built there yet
    native_build.load.cache_clear()
    native_rowwise_adagrad.kernel.cache_clear()
    try:
        assert embedding_update.choose("auto") == "fbgemm"
        assert embedding_update.choose("auto", weight_decay=1e-4) == "vectorized", "fbgemm's ignores decay"
        with pytest.raises(RuntimeError, match=r"'native': no C compiler.*set training.cpu.embedding_update = 'vectorized'"):
            embedding_update.use("native")
        assert embedding_update.installed() == "fbgemm"
    finally:
        native_build.load.cache_clear()
        native_rowwise_adagrad.kernel.cache_clear()


def test_a_decayed_run_is_never_left_to_fbgemms_cpu_kernel() -> None:
    from training.config import CpuConfig, TrainingConfig

    assert embedding_update.choose("auto", weight_decay=1e-4) == "native"
    with pytest.raises(ValueError, match="embedding_weight_decay: fbgemm's CPU kernel ignores it"):
        TrainingConfig(embedding_weight_decay=1e-4, cpu=CpuConfig(embedding_update="fbgemm"))
