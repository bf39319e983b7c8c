"""Exact row-wise Adagrad for fbgemm's CPU embedding backward, in vectorised torch ops.

TorchRec's fused embedding optimizer runs inside fbgemm's table-batched embedding backward
(`fbgemm::split_embedding_backward_codegen_rowwise_adagrad_cpu`). On CPU, fbgemm updates
each touched row with a JIT-compiled kernel that mixes AVX2 (VEX) and legacy SSE scalar
instructions. On CPUs that charge for switching between the two (seen on a 2-core Xeon
VM with AVX-512 and AMX: about 100 ns per switch, measured in isolation) every row costs
about 550 ns: a batch of 2048 × 26 ids with 53k distinct rows took 29 ms, against 3.7 ms
here, and the benchmark's batches (5.6k distinct rows) 4.4 ms against 1.6 ms.

`training/cpu/embedding_update.py` registers it (or the native C loop,
training/cpu/native_rowwise_adagrad.py) as that op's CPU kernel. Same update, same state
layout: checkpoints, sharding and the fused optimizer's state are TorchRec's. For each
distinct row r of a table, with g the sum of its occurrences' gradients in the batch:

    m[r] += mean(g²);  w[r] -= lr · g / (√m[r] + eps)

Summation order matches fbgemm's (occurrences in batch order), so results agree with it to
float rounding of the mean square.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

POOLING_SUM, POOLING_MEAN = 0, 1
# fbgemm's WeightDecayMode: NONE ignores `weight_decay`; L2 adds weight_decay · w to the
# gradient of each row a step touches. The other modes are fbgemm's alone.
DECAY_NONE, DECAY_L2 = 0, 1
# Distinct rows are found through a scratch array over every row of the batched tables
# (4 bytes a row): cheaper than sorting the ids, up to this many rows; a sort beyond.
SCRATCH_MAX_ROWS = 1 << 23

_scratch: dict[int, torch.Tensor] = {}


class FbgemmArgs(NamedTuple):
    """The arguments of fbgemm's CPU row-wise Adagrad backward op, by its schema (the one
    copy of it here: training/cpu/embedding_update.py checks it against the installed op)."""

    grad_output: torch.Tensor
    host_weights: torch.Tensor
    weights_placements: torch.Tensor
    weights_offsets: torch.Tensor
    D_offsets: torch.Tensor
    max_D: int
    hash_size_cumsum: torch.Tensor
    total_hash_size_bits: int
    indices: torch.Tensor
    offsets: torch.Tensor
    pooling_mode: int
    indice_weights: torch.Tensor | None
    stochastic_rounding: bool
    momentum1_host: torch.Tensor
    momentum1_placements: torch.Tensor
    momentum1_offsets: torch.Tensor
    learning_rate_tensor: torch.Tensor
    eps: float = 0.0
    weight_decay: float = 0.0
    weight_decay_mode: int = 0
    max_norm: float = 0.0
    output_dtype: int = 0


def rowwise_adagrad_backward(a: FbgemmArgs) -> None:
    """Applies one step of exact row-wise Adagrad to `host_weights` and `momentum1_host`, in
    place, for the pooled lookups of `indices`/`offsets` whose output gradient is
    `grad_output` [B, ΣD]."""
    check_supported(a.host_weights, a.momentum1_host, a.pooling_mode, a.weight_decay_mode, a.max_norm)
    if a.indices.numel() == 0:
        return
    lr, decay = float(a.learning_rate_tensor), l2_decay(a)
    dims = a.D_offsets.diff()
    batch = (a.offsets.numel() - 1) // dims.numel()
    bag, scale = _bags(a.offsets, a.indices.numel(), a.pooling_mode, a.indice_weights)
    grad_output = a.grad_output.float()
    widths = dims.unique().tolist()
    if bag is None and scale is None and len(widths) == 1:
        _one_id_per_bag(grad_output, a.host_weights, a.weights_offsets, a.hash_size_cumsum, a.indices, a.momentum1_host,
                        a.momentum1_offsets, lr, a.eps, decay, widths[0], batch)  # fmt: skip
        return
    if bag is None and len(widths) > 1:
        bag = torch.arange(a.indices.numel())
    feature_of_id = (torch.arange(a.indices.numel()) if bag is None else bag).div(batch, rounding_mode="floor")
    for dim in widths:
        if dim == 0:
            continue
        if bool((dims == dim).all()):
            ids, feature, factor = a.indices.long(), feature_of_id, scale
            grads = _uniform_grads(grad_output, dim, bag)
        else:
            chosen = (dims.index_select(0, feature_of_id) == dim).nonzero().squeeze(1)
            ids, feature = a.indices.index_select(0, chosen).long(), feature_of_id.index_select(0, chosen)
            factor = None if scale is None else scale.index_select(0, chosen)
            grads = _sliced_grads(grad_output, a.D_offsets, dim, bag.index_select(0, chosen), feature, batch)
        if factor is not None:
            grads = grads * factor.unsqueeze(1)
        keys = a.hash_size_cumsum.index_select(0, feature) + ids  # one row of the batched tables: one key
        slots, first = _distinct(keys, int(a.hash_size_cumsum[-1]))
        summed = _summed(grads, slots, first.numel())
        _update(a.host_weights, a.weights_offsets, a.momentum1_host, a.momentum1_offsets, summed,
                feature.index_select(0, first), ids.index_select(0, first), lr, a.eps, decay)  # fmt: skip


def _one_id_per_bag(grad_output: torch.Tensor, host_weights: torch.Tensor, weights_offsets: torch.Tensor,
                    hash_size_cumsum: torch.Tensor, indices: torch.Tensor, momentum1_host: torch.Tensor,
                    momentum1_offsets: torch.Tensor, lr: float, eps: float, decay: float, dim: int,
                    batch: int) -> None:  # fmt: skip
    """The common case (one id per feature and sample, every feature `dim` wide) without
    reordering the gradient: ids come feature-major [F, B], `grad_output` is [B, F, D]."""
    ids = indices.long().view(-1, batch)
    keys = (ids + hash_size_cumsum[:-1].unsqueeze(1)).reshape(-1)
    slots, first = _distinct(keys, int(hash_size_cumsum[-1]))
    # the slots in the gradient's sample-major order: a row's occurrences still sum by sample
    summed = _summed(grad_output.reshape(-1, dim), slots.view(ids.shape).t().reshape(-1), first.numel())
    _update(host_weights, weights_offsets, momentum1_host, momentum1_offsets, summed,
            first.div(batch, rounding_mode="floor"), ids.view(-1).index_select(0, first), lr, eps, decay)  # fmt: skip


def _summed(grads: torch.Tensor, slots: torch.Tensor, distinct: int) -> torch.Tensor:
    """[distinct, D]: the gradients of each distinct row's ids, added in id order."""
    summed = torch.zeros(distinct, grads.shape[1], dtype=torch.float32)
    return summed.scatter_add_(0, slots.unsqueeze(1).expand_as(grads), grads)


def _update(host_weights: torch.Tensor, weights_offsets: torch.Tensor, momentum1_host: torch.Tensor,
            momentum1_offsets: torch.Tensor, summed: torch.Tensor, feature: torch.Tensor, rows: torch.Tensor,
            lr: float, eps: float, decay: float) -> None:  # fmt: skip
    """Row-wise Adagrad on each distinct (feature's table, row) with its summed gradient
    (plus `decay` times the row: L2 on the rows the step touches)."""
    dim = summed.shape[1]
    if decay:
        starts = weights_offsets.index_select(0, feature) + rows * dim
        summed.add_(host_weights[starts.unsqueeze(1) + torch.arange(dim)], alpha=decay)
    moment_at = momentum1_offsets.index_select(0, feature) + rows
    moment = momentum1_host.index_select(0, moment_at).add_(summed.square().mean(1))
    momentum1_host.index_copy_(0, moment_at, moment)
    step = summed.mul_((-lr / moment.sqrt_().add_(eps)).unsqueeze(1))
    _add_rows(host_weights, weights_offsets.index_select(0, feature) + rows * dim, dim, step)


def l2_decay(a: FbgemmArgs) -> float:
    """The L2 coefficient this step applies (0 unless fbgemm's L2 mode is on)."""
    return float(a.weight_decay) if a.weight_decay_mode == DECAY_L2 else 0.0


def check_supported(weights: torch.Tensor, momentum: torch.Tensor, pooling_mode: int, weight_decay_mode: int,
                     max_norm: float) -> None:  # fmt: skip
    problem = None
    if weights.dtype != torch.float32 or momentum.dtype != torch.float32:
        problem = f"{weights.dtype} embedding weights (fp32 only)"
    elif pooling_mode not in (POOLING_SUM, POOLING_MEAN):
        problem = f"pooling mode {pooling_mode} (sum and mean only)"
    elif weight_decay_mode not in (DECAY_NONE, DECAY_L2) or max_norm:
        problem = f"weight decay mode {weight_decay_mode} or max-norm on embeddings (L2 decay only)"
    if problem:
        raise NotImplementedError(
            f"training.cpu.embedding_update = 'vectorized' or 'native' does not handle {problem}; "
            "set training.cpu.embedding_update = 'fbgemm'"
        )


def _bags(offsets: torch.Tensor, count: int, pooling_mode: int,
          indice_weights: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """Each id's bag (feature-major: feature · B + sample; None when id i is bag i) and the
    factor on its bag's gradient (None: 1)."""
    bags = offsets.numel() - 1
    lengths = offsets.diff()
    one_per_bag = count == bags and bool((lengths == 1).all())
    bag = None if one_per_bag else torch.repeat_interleave(torch.arange(bags), lengths.long(), output_size=count)
    scale = None
    if pooling_mode == POOLING_MEAN and bag is not None:
        scale = lengths.clamp(min=1).float().reciprocal().index_select(0, bag)
    if indice_weights is not None and indice_weights.numel():
        scale = indice_weights.float() if scale is None else scale * indice_weights.float()
    return bag, scale


def _uniform_grads(grad_output: torch.Tensor, dim: int, bag: torch.Tensor | None) -> torch.Tensor:
    """[ids, dim] when every feature is `dim` wide: [B, F·D] seen feature-major, by bag."""
    by_bag = grad_output.reshape(grad_output.shape[0], -1, dim).transpose(0, 1).reshape(-1, dim)
    return by_bag if bag is None else by_bag.index_select(0, bag)


def _sliced_grads(grad_output: torch.Tensor, D_offsets: torch.Tensor, dim: int, bag: torch.Tensor,
                  feature: torch.Tensor, batch: int) -> torch.Tensor:  # fmt: skip
    """[ids, dim]: each id's slice of its sample's output gradient (features of mixed width)."""
    width = grad_output.shape[1]
    start = (bag - feature * batch) * width + D_offsets.index_select(0, feature)
    return grad_output.reshape(-1)[start.unsqueeze(1) + torch.arange(dim)]


def _distinct(keys: torch.Tensor, key_space: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot of each key among the distinct keys, numbered in order of first occurrence;
    the position of each distinct key's first occurrence). The same on every run: nothing
    depends on which of two threads writes first."""
    count = keys.numel()
    if key_space > SCRATCH_MAX_ROWS:
        _, slots = torch.unique(keys, return_inverse=True)
        first = torch.full((int(slots.max()) + 1,), count, dtype=torch.int64)
        first.scatter_reduce_(0, slots, torch.arange(count), reduce="amin")
        order = first.argsort()  # slots by first occurrence, as the scratch path numbers them
        return order.argsort().index_select(0, slots), first.index_select(0, order)
    scratch = _scratch.get(key_space)
    if scratch is None:
        scratch = _scratch[key_space] = torch.empty(key_space, dtype=torch.int32)
    positions = torch.arange(count, dtype=torch.int32)
    scratch.index_fill_(0, keys, count)
    scratch.scatter_reduce_(0, keys, positions, reduce="amin")  # each key's first position
    first_of_key = scratch.index_select(0, keys)
    is_first = first_of_key == positions
    slot_of_first = is_first.cumsum(0).sub_(1)
    return slot_of_first.index_select(0, first_of_key.long()), is_first.nonzero().squeeze(1)


def _add_rows(weights: torch.Tensor, starts: torch.Tensor, dim: int, step: torch.Tensor) -> None:
    """weights[start : start + dim] += step[i] for each distinct start."""
    if bool((starts % dim == 0).all()) and weights.numel() % dim == 0:
        weights.view(-1, dim).index_add_(0, starts.div(dim, rounding_mode="floor"), step)
    else:
        weights.index_add_(0, (starts.unsqueeze(1) + torch.arange(dim)).reshape(-1), step.reshape(-1))


def reset_scratch() -> None:
    """Free the distinct-row scratch arrays (kept between steps while the kernel is in use)."""
    _scratch.clear()
