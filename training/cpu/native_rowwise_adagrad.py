"""Exact row-wise Adagrad for fbgemm's CPU embedding backward, as one C loop over the ids.

The same update and arguments as training/cpu/rowwise_adagrad.py's vectorised kernel, in
one pass (training/cpu/native/rowwise_adagrad.c): a row's gradients are summed in a hash table
the size of the batch, not through torch ops that each go over every id, and the rows'
updates prefetch the rows ahead of them, which lie anywhere in tables far larger than the
caches. Registered as fbgemm's CPU kernel by training/cpu/embedding_update.py.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from training.cpu import native_build
from training.cpu.rowwise_adagrad import POOLING_MEAN, FbgemmArgs, check_supported, l2_decay

_P, _I = ctypes.c_void_p, ctypes.c_int64
_F = ctypes.c_float
_ARGUMENTS = (_P, _P, _I, _P, _P, _P, _P, _P, _I, _P, _P, _P, ctypes.c_int32, _F, _F, _F,
              _P, _P, _I, _P, _I, _P, _P, _I)  # fmt: skip
_work: dict[str, torch.Tensor] = {}


@functools.lru_cache(maxsize=1)
def kernel():
    """The compiled C function (raises `native_build.NativeUnavailable` where it cannot build)."""
    function = native_build.load("rowwise_adagrad").dlrm_rowwise_adagrad
    function.argtypes, function.restype = _ARGUMENTS, ctypes.c_int64
    return function


def rowwise_adagrad_backward(a: FbgemmArgs) -> None:
    """One step of exact row-wise Adagrad on `host_weights` and `momentum1_host`, in place."""
    check_supported(a.host_weights, a.momentum1_host, a.pooling_mode, a.weight_decay_mode, a.max_norm)
    if a.indices.numel() == 0:
        return
    features = a.D_offsets.numel() - 1
    batch = (a.offsets.numel() - 1) // features
    order, group_end, groups = _groups(tuple(a.hash_size_cumsum[:-1].tolist()))
    ids_per_feature = a.offsets[::batch].diff().tolist()
    largest = max(sum(ids_per_feature[f] for f in group) for group in groups)
    hash_bits = max(1, (2 * largest - 1).bit_length())  # at most half full
    grad, grad_start, sample_stride = _feature_major(a.grad_output.float(), a.D_offsets, features, batch)
    # every tensor the kernel reads is bound to a name here: a temporary's memory would be
    # freed before the call
    indices, offsets = a.indices.long().contiguous(), a.offsets.long().contiguous()
    weights = a.indice_weights.float().contiguous() if a.indice_weights is not None and a.indice_weights.numel() else None
    weights_offsets, momentum1_offsets, D_offsets = map(_long, (a.weights_offsets, a.momentum1_offsets, a.D_offsets))
    hash_table = _buffer("hash", 2 << hash_bits, torch.int64)
    sums, rows = _buffer("sums", largest * a.max_D, torch.float32), _buffer("rows", largest, torch.int64)
    kernel()(
        grad.data_ptr(), grad_start.data_ptr(), sample_stride,
        a.host_weights.data_ptr(), weights_offsets.data_ptr(), a.momentum1_host.data_ptr(), momentum1_offsets.data_ptr(),
        D_offsets.data_ptr(), batch, indices.data_ptr(), offsets.data_ptr(),
        weights.data_ptr() if weights is not None else None, int(a.pooling_mode == POOLING_MEAN),
        float(a.learning_rate_tensor), float(a.eps), l2_decay(a), order.data_ptr(), group_end.data_ptr(), features,
        hash_table.data_ptr(), hash_bits, sums.data_ptr(), rows.data_ptr(), a.max_D,
    )  # fmt: skip


@functools.lru_cache(maxsize=16)
def _groups(key_bases: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """Features grouped by table (features of one table share its key base), in feature
    order within a group: (order, group_end flags, the groups)."""
    groups: dict[int, list[int]] = {}
    for feature, base in enumerate(key_bases):
        groups.setdefault(base, []).append(feature)
    ordered = list(groups.values())
    order = torch.tensor([f for group in ordered for f in group], dtype=torch.int64)
    ends = torch.tensor([i == len(group) - 1 for group in ordered for i in range(len(group))], dtype=torch.uint8)
    return order, ends, ordered


def _feature_major(grad: torch.Tensor, D_offsets: torch.Tensor, features: int,
                   batch: int) -> tuple[torch.Tensor, torch.Tensor, int]:  # fmt: skip
    """(gradient, where feature f's rows start, the stride between samples): a
    feature-major copy when every feature has the same width, else fbgemm's [B, ΣD]."""
    width = grad.shape[1]
    if features and width % features == 0 and bool((D_offsets.diff() == width // features).all()):
        dim = width // features
        copy = grad.view(batch, features, dim).transpose(0, 1).contiguous()
        return copy, torch.arange(features, dtype=torch.int64) * (batch * dim), dim
    grad = grad.contiguous()
    return grad, _long(D_offsets[:-1]), grad.stride(0)


def _long(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.int64).contiguous()


def _buffer(name: str, size: int, dtype: torch.dtype) -> torch.Tensor:
    """Work memory kept between steps (grown, never shrunk)."""
    buffer = _work.get(name)
    if buffer is None or buffer.numel() < size:
        buffer = _work[name] = torch.empty(max(size, 1), dtype=dtype)
    return buffer
