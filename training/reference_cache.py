"""Fitted references kept by what they were fitted on: the same rows, seed, sample and folds
give the same regression (training/reference.py: full batch, fixed starts), so a run fits
it once and every later use reuses it: the refit of a run that chose its length and the
evaluate stage that follows it, a rerun of the same command, a retune's comparison, another
run folder over byte-identical feature files.

An entry is named by a digest of the inputs: each training file's bytes (not its path: the
same features in another folder are the same rows), the table sizes, the options, and the
code that fits and reads (a change to either fits again). Entries live in the user's cache
(`training/user_cache.py`), the newest `KEPT_ENTRIES` of them; an entry that cannot be read
is fitted again and replaced.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

import ingestion.count_bins
import ingestion.cross_ids
import ingestion.reader
import training.reference
from ingestion.count_bins import CountBins
from ingestion.cross_ids import Cross
from ingestion.file_digest import content_digest
from training.reference import HashedLogisticRegression, LogisticFit, fit_logistic_regression
from training.user_cache import user_cache

KEPT_ENTRIES = 32


@dataclasses.dataclass(frozen=True)
class ReferenceFit:
    """A fitted reference, and whether it was read back rather than fitted by this call."""

    fit: LogisticFit
    reused: bool

    @property
    def how_chosen(self) -> str:
        return self.fit.how_chosen + (" (the same rows' fit, reused)" if self.reused else "")


def reference_cache() -> Path:
    return user_cache() / "reference"


def fitted_reference(table_sizes: Mapping[str, int], train_files: Sequence[str], *, seed: int = 0, max_rows: int = 0,
                     folds: int = 0, raw_ids: bool = False, crosses: Sequence[Cross] = (), per_feature_l2: bool = False,
                     count_bins: Sequence[CountBins] = (), cache: Path | None = None) -> ReferenceFit:  # fmt: skip
    """`fit_logistic_regression` with these options, read from `cache` (default: the user's)
    when the same inputs were fitted before, else fitted and kept there. The pipeline's callers
    leave `seed` at 0: the reference is the run's fixed yardstick, and its folds choose the
    crossed pairs and the wide start, so a run's `training.seed` moves only the model's own
    draw (initialisation, order), not the pairs it crosses or the regression it is judged by."""
    folder = cache or reference_cache()
    try:
        digest = inputs_digest(table_sizes, train_files, seed, max_rows, folds, raw_ids, crosses, per_feature_l2,
                               count_bins)  # fmt: skip
        entry: Path | None = folder / f"{digest}.pt"
    except OSError:  # a file that cannot be read as bytes here: the fit says what is wrong with it
        entry = None
    kept = _read(entry, table_sizes, raw_ids) if entry else None
    if entry and kept is not None:
        with contextlib.suppress(OSError):
            os.utime(entry)  # newest use: kept longest
        return ReferenceFit(kept, reused=True)
    fit = fit_logistic_regression(table_sizes, list(train_files), seed=seed, max_rows=max_rows, folds=folds,
                                  raw_ids=raw_ids, crosses=crosses, per_feature_l2=per_feature_l2,
                                  count_bins=count_bins)  # fmt: skip
    if entry:
        with contextlib.suppress(OSError):  # a cache that cannot be written only costs the next run a fit
            _write(entry, fit)
            _prune(folder, KEPT_ENTRIES)
    return ReferenceFit(fit, reused=False)


def inputs_digest(table_sizes: Mapping[str, int], train_files: Sequence[str], seed: int, max_rows: int, folds: int,
                  raw_ids: bool, crosses: Sequence[Cross] = (), per_feature_l2: bool = False,
                  count_bins: Sequence[CountBins] = ()) -> str:  # fmt: skip
    """Names everything a fit depends on: the files' bytes in their order, the options, the code."""
    digest = hashlib.sha256()
    options = {"tables": list(table_sizes.items()), "seed": seed, "max_rows": max_rows, "folds": folds,
               "raw_ids": raw_ids, "crosses": [dataclasses.astuple(cross) for cross in crosses],
               **({"per_feature_l2": True} if per_feature_l2 else {}),
               **({"count_bins": [dataclasses.astuple(bins) for bins in count_bins]} if count_bins else {}),
               "torch": torch.__version__}  # fmt: skip
    digest.update(json.dumps(options, sort_keys=True).encode())
    for module in (training.reference, ingestion.reader, ingestion.cross_ids, ingestion.count_bins):
        digest.update(Path(module.__file__).read_bytes())
    for file in train_files:
        digest.update(content_digest(str(file))[0].encode())
    return digest.hexdigest()[:32]


def _write(entry: Path, fit: LogisticFit) -> None:
    """The weights and every figure of the fit, published by a rename (a reader sees a whole entry)."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    arrays = ("model", "out_of_fold")  # kept as tensors, not figures
    figures = {field.name: getattr(fit, field.name) for field in dataclasses.fields(fit) if field.name not in arrays}
    figures["validation_ne_by_c"] = [[c, ne] for c, ne in fit.validation_ne_by_c.items()]
    staged = entry.with_name(f".{entry.name}.{os.getpid()}-{threading.get_ident()}.staged")
    text = json.dumps(figures, default=lambda value: value.item())  # numpy scalars as Python numbers
    out_of_fold = torch.from_numpy(fit.out_of_fold) if fit.out_of_fold is not None else None
    torch.save({"figures": text, "dense_features": fit.model.dense.in_features, "weights": fit.model.state_dict(),
                "out_of_fold": out_of_fold}, staged)  # fmt: skip
    os.replace(staged, entry)


def _read(entry: Path, table_sizes: Mapping[str, int], raw_ids: bool) -> LogisticFit | None:
    if not entry.is_file():
        return None
    try:
        kept = torch.load(entry, weights_only=True)
        model = HashedLogisticRegression(table_sizes, int(kept["dense_features"]), raw_ids)
        model.load_state_dict(kept["weights"])
        figures = json.loads(kept["figures"])
        figures["validation_ne_by_c"] = {float(c): float(ne) for c, ne in figures["validation_ne_by_c"]}
        out_of_fold = kept["out_of_fold"].numpy() if kept["out_of_fold"] is not None else None
        return LogisticFit(model=model.eval(), out_of_fold=out_of_fold, **figures)
    except Exception:  # noqa: BLE001 - a torn or foreign entry: fit again (and replace it)
        return None


def _prune(folder: Path, keep: int) -> None:
    """Only the `keep` most recently used entries stay."""
    entries = sorted(folder.glob("*.pt"), key=lambda path: path.stat().st_mtime_ns, reverse=True)
    for old in entries[keep:]:
        old.unlink(missing_ok=True)
