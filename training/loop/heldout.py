"""Scoring the evaluation parts with the model being trained: a held-out NE during
training, and every rank's predictions once it is done."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from evaluation.distributed import reduced_state, tensor_state
from evaluation.metrics import BinaryState
from ingestion.reader import PAD_LABEL, build_reader, first_ids
from training.job import TrainJob
from training.loop.steps import autocast
from training.model.objective import real_rows


@torch.no_grad()
def heldout_state(model: nn.Module, job: TrainJob, device: torch.device) -> BinaryState:
    """The summed state of the first `evaluation.heldout_batches` batches of the evaluation
    parts on every rank (the same count everywhere; 0: all of them)."""
    files = [f for part_files in job.eval_files.values() for f in part_files]
    return files_state(model, files, job, device, job.evaluation.heldout_batches)


@torch.no_grad()
def files_state(model: nn.Module, files: Sequence[str], job: TrainJob, device: torch.device,
                max_batches: int = 0) -> BinaryState:  # fmt: skip
    """The summed state of `files` scored by `model`, over every rank's share (the first
    `max_batches` batches of each rank's; 0: all)."""
    reader = build_reader(list(files), job.evaluation.batch_size, dist.get_rank(), dist.get_world_size(),
                          drop_remainder=False, prefetch=0, crosses=job.crosses, count_bins=job.count_bins)  # fmt: skip
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=device)
    for index, batch in enumerate(reader):
        if index == max_batches > 0:
            break
        with autocast(job.training, device):
            _, (_, logits, labels) = model(batch.to(device, non_blocking=True))
        sums += tensor_state(labels, torch.sigmoid(logits.double()), real_rows(labels))
    model.train()
    return reduced_state(sums)


@torch.no_grad()
def predict(model: nn.Module, job: TrainJob, device: torch.device) -> int:
    """Score this rank's share of each evaluation part, and of the calibration rows, into the
    job folder's predictions (label, prediction, and the row's id of the slice feature);
    returns the rows scored."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model.eval()
    rows = 0
    for part, files in job.scored_parts.items():
        labels, predictions, slices = [], [], []
        for batch in build_reader(files, job.evaluation.batch_size, rank, world, drop_remainder=False, crosses=job.crosses,
                                  count_bins=job.count_bins):
            with autocast(job.training, device):
                _, (_, logits, batch_labels) = model(batch.to(device, non_blocking=True))
            keep = (batch_labels != PAD_LABEL).cpu()
            labels.append(batch_labels.cpu()[keep].numpy())
            predictions.append(torch.sigmoid(logits.float()).cpu()[keep].numpy())
            slices.append(first_ids(batch.sparse_features, job.evaluation.slice_feature)[keep].numpy())
        rows += job.folder.write_predictions(part, rank, np.concatenate(labels), np.concatenate(predictions),
                                             np.concatenate(slices))  # fmt: skip
    return rows
