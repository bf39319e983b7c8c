"""Which checkpoints a training job may resume from.

A job's checkpoints live in `out/checkpoints/<fingerprint>/`, where the fingerprint covers
everything that decides the trained parameters: the model, the sharding, the training
settings, the table sizes and the training files (their paths, sizes and Parquet footers).
The same command after an interruption therefore finds its own checkpoints and resumes;
a changed configuration or changed data gets a new folder, starts at step 0, and says
which settings differ from the interrupted run's.

A job that ran to its end leaves a `FINISHED` mark: running it again trains again from
step 0 (a rerun is a new model, not a no-op). Run folders beyond `training.keep_checkpoints`
(the newest first) are removed, as old steps within a folder are.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from training.job import TrainJob
from training.loop.checkpoint_chain import latest_checkpoint

FINISHED = "FINISHED"
FINGERPRINT_FILE = "fingerprint.json"  # what the fingerprint covers, kept beside the checkpoints
FOOTER_BYTES = 65_536  # a Parquet file's footer: its schema, row groups and statistics
# Settings that change how often or how a job saves, or retries, not what it learns (either
# checkpoint mode reads the other's checkpoints, so a run resumes across a change of mode)
NOT_FINGERPRINTED = {"checkpoint_every", "keep_checkpoints", "max_restarts", "torchrun_args", "checkpoint_mode",
                     "full_checkpoint_every"}  # fmt: skip


def fingerprinted(job: TrainJob) -> dict[str, Any]:
    """What decides the job's trained parameters, as plain data."""
    training = {k: v for k, v in dataclasses.asdict(job.training).items() if k not in NOT_FINGERPRINTED}
    return {
        "model": dataclasses.asdict(job.model),
        "sharding": dataclasses.asdict(job.sharding),
        "training": training,
        "table_sizes": dict(job.table_sizes),
        "pooling_factors": dict(job.pooling_factors),
        "init_checkpoint": job.init_checkpoint,
        "init_optimizer": job.init_optimizer,
        "train_files": [_file_identity(path) for path in job.train_files],
    }


def job_fingerprint(job: TrainJob) -> str:
    text = json.dumps(fingerprinted(job), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def prepare_checkpoints(job: TrainJob) -> str:
    """Ready `job.checkpoint_root` for a launch; returns one line saying where training
    starts and why."""
    root = job.checkpoint_root
    if (root / FINISHED).is_file():
        shutil.rmtree(root)
        reason = "this job ran to its end before: training again from step 0"
    elif (latest := latest_checkpoint(root)) is not None:
        reason = f"resuming the interrupted run from {latest.name} ({root})"
    else:
        reason = _fresh_start_reason(job, root)
    root.mkdir(parents=True, exist_ok=True)
    (root / FINGERPRINT_FILE).write_text(json.dumps(fingerprinted(job), sort_keys=True, indent=1, default=str))
    os.utime(root)  # the newest folder: the one retention keeps first
    _keep_newest(root.parent, job.training.keep_checkpoints)
    return reason


def mark_finished(job: TrainJob) -> None:
    (job.checkpoint_root / FINISHED).touch()


def _fresh_start_reason(job: TrainJob, root: Path) -> str:
    interrupted = [
        folder for folder in _run_folders(root.parent)
        if folder != root and not (folder / FINISHED).is_file() and latest_checkpoint(folder) is not None
    ]  # fmt: skip
    if not interrupted:
        return "starting at step 0"
    newest = max(interrupted, key=lambda folder: folder.stat().st_mtime)
    changed = _differences(_read_job(newest), fingerprinted(job))
    return (f"starting at step 0, not resuming the interrupted run in {newest}: "
            f"{'; '.join(changed[:4]) or 'its job file is unreadable'}"
            + (f" (and {len(changed) - 4} more)" if len(changed) > 4 else ""))  # fmt: skip


def _differences(before: dict[str, Any], now: dict[str, Any], prefix: str = "") -> list[str]:
    """`section.key was → is` for every setting that differs (the data files as one entry)."""
    changed = []
    for key in sorted(set(before) | set(now)):
        a, b = before.get(key), now.get(key)
        name = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict) and key != "table_sizes":
            changed += _differences(a, b, f"{name}.")
        elif a != b:
            changed.append("the training data changed" if key in {"train_files", "table_sizes"}
                           else f"{name} {json.dumps(a)} → {json.dumps(b)}")  # fmt: skip
    return list(dict.fromkeys(changed))


def _read_job(folder: Path) -> dict[str, Any]:
    try:
        return json.loads((folder / FINGERPRINT_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _run_folders(checkpoints: Path) -> list[Path]:
    return [p for p in checkpoints.iterdir() if p.is_dir()] if checkpoints.is_dir() else []


def _keep_newest(checkpoints: Path, keep: int) -> None:
    folders = sorted(_run_folders(checkpoints), key=lambda folder: folder.stat().st_mtime, reverse=True)
    for stale in folders[keep:]:
        shutil.rmtree(stale, ignore_errors=True)


def _file_identity(path: str) -> list[Any]:
    """Path, size and a hash of the Parquet footer: rewritten data with other rows differs."""
    file = Path(path)
    if not file.is_file():
        return [path, None, None]
    size = file.stat().st_size
    with file.open("rb") as handle:
        handle.seek(max(0, size - FOOTER_BYTES))
        footer = hashlib.sha256(handle.read()).hexdigest()[:16]
    return [path, size, footer]
