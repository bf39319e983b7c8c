"""Recurring training: a run "as of day N" continues the champion on the days it has not seen.

Every registered version carries its lineage as MLflow model-version tags: the days it
has trained on (`lineage.days`, the parent's and its own), the version it continued
(`lineage.parent_version`), the day it was judged on (`lineage.as_of`), its preprocessing
state, where its final checkpoint is kept (`lineage.checkpoint`) and how many of its table
rows differ from the parent's (`lineage.rows_changed`; which: the model's
`rows_changed.parquet`). A run as of day N:

- with a champion: trains the days before N (from the first configured training day on)
  that the champion's lineage lacks, starting from the champion's checkpoint (weights and
  optimizer state, resharded on load), its model shape and its preprocessing state;
- without one (or with one registered before lineages existed): trains from scratch on
  the configured training days before N;
- in both cases evaluates on day N, which neither the candidate nor the champion has
  trained on, and promotes as usual. A second run as of the same N trains nothing.

Checkpoints are kept by hard links under `<run_dir>/lineage/`, outside the training
folder's retention; only the champion's is kept once a run has been judged.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import mlflow
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from flows.run.config import ConfigError, PipelineConfig
from flows.run.nights import Night, WarmStart, check_catch_up, tagged_day, tagged_days
from flows.run.reports import SkippedNight
from flows.run.sources import complete_days
from flows.tracking.registry import current_champion
from flows.tracking.runs import logged_state
from ingestion.preprocess import PreprocessState
from training.codec import decode
from training.config import ModelConfig
from training.loop.checkpoint_chain import META, BrokenChain, chain_of

TAG_AS_OF = "lineage.as_of"
TAG_DAYS = "lineage.days"
TAG_PARENT = "lineage.parent_version"
TAG_CHECKPOINT = "lineage.checkpoint"
TAG_STATE = "preprocessing.state_id"
# the table rows that differ from the parent version's (training/serving/export.ROWS_CHANGED)
TAG_ROWS_CHANGED = "lineage.rows_changed"
LINEAGE_TAGS = (TAG_AS_OF, TAG_DAYS, TAG_PARENT, TAG_CHECKPOINT, TAG_STATE)


def plan_night(config: PipelineConfig, as_of: int, client: MlflowClient) -> Night:
    """Which days a run as of `as_of` trains, and from which champion (see the module)."""
    day, days_of = config.data.shown, config.data.shown_days
    name = config.tracking.registered_model
    champion = continued_version(config, client)  # the champion, or the newest version (continue_from)
    parent = champion.version if champion else ""
    earlier = [v for v in _versions(client, name)
               if tagged_day(v.tags.get(TAG_AS_OF)) == as_of and v.tags.get(TAG_PARENT, "") == str(parent)]  # fmt: skip
    if earlier:
        version = max(earlier, key=lambda v: int(v.version))
        return Night(as_of, (), skipped=f"version {version.version} already trained as of day {day(as_of)} from "
                     f"{'champion version ' + str(parent) if parent else 'scratch'}; nothing new to train",
                     earlier_version=str(version.version))  # fmt: skip
    if champion is None or TAG_DAYS not in champion.tags:
        why = ("no champion yet" if champion is None else
               f"champion version {champion.version} has no lineage (registered before recurring runs)")
        days = tuple(d for d in config.data.train_days if d < as_of)
        if not days:
            raise ConfigError(f"--as-of {day(as_of)}: no configured training day (data.train_days "
                              f"{days_of(config.data.train_days)}) is before day {day(as_of)}")  # fmt: skip
        return Night(as_of, days, note=f"{why}: training from scratch on days {days_of(days)}, evaluating on day "
                     f"{day(as_of)}")  # fmt: skip
    lineage = tagged_days(champion.tags[TAG_DAYS])
    unseen = tuple(d for d in _days_before(config, as_of) if d not in lineage)
    if not unseen:
        return Night(as_of, (), skipped=f"champion version {champion.version} has trained on every day before "
                     f"{day(as_of)} (lineage {days_of(lineage)}); nothing new to train",
                     earlier_version=str(champion.version))  # fmt: skip
    check_catch_up(config, champion.version, lineage, unseen, as_of)
    warm = _warm_start(config, champion, lineage)
    which = "champion" if config.orchestration.continue_from == "champion" else "the newest trained"
    return Night(as_of, unseen, warm, note=f"continuing {which} version {champion.version} (lineage "
                 f"{days_of(lineage)}) on days {days_of(unseen)}, evaluating on day {day(as_of)}")  # fmt: skip


def continued_version(config: PipelineConfig, client: MlflowClient) -> ModelVersion | None:
    """The version a night continues: the champion, or with `orchestration.continue_from =
    "latest"` the newest version with a lineage and a kept checkpoint (the champion when none)."""
    name = config.tracking.registered_model
    champion = current_champion(client, name)
    if config.orchestration.continue_from == "champion":
        return champion
    trained = [v for v in _versions(client, name) if TAG_DAYS in v.tags and v.tags.get(TAG_CHECKPOINT)]
    return max(trained, key=lambda v: int(v.version), default=None) or champion


def _days_before(config: PipelineConfig, as_of: int) -> list[int]:
    first = min(config.data.train_days)
    if config.data.source == "synthetic":
        return list(range(first, as_of))  # the generator writes whichever days are needed
    return [day for day in complete_days(config) if first <= day < as_of]


def _versions(client: MlflowClient, name: str) -> list[ModelVersion]:
    try:
        return list(client.search_model_versions(f"name='{name}'"))
    except MlflowException:
        return []


def _warm_start(config: PipelineConfig, champion: ModelVersion, lineage: tuple[int, ...]) -> WarmStart:
    checkpoint = champion.tags.get(TAG_CHECKPOINT, "")
    if not checkpoint or not (Path(checkpoint) / "meta.json").is_file():
        raise ConfigError(f"the champion (version {champion.version}) cannot be continued: its checkpoint "
                          f"{checkpoint or '(none recorded)'} is gone; restore it, or start a new lineage with "
                          "`dlrm run` (no --as-of) on the days it should know")  # fmt: skip
    resolved = mlflow.artifacts.download_artifacts(run_id=champion.run_id, artifact_path="config/resolved_config.json",
                                                   tracking_uri=config.tracking_uri)  # fmt: skip
    model = decode(ModelConfig, json.loads(Path(resolved).read_text())["model"], "the champion's model")
    return WarmStart(str(champion.version), champion.run_id, checkpoint, lineage, model,
                     logged_state(config.tracking_uri, champion.run_id))  # fmt: skip


def lineage_tags(config: PipelineConfig, night: Night, state: PreprocessState, kept_checkpoint: str) -> dict[str, str]:
    """The version's lineage as MLflow tags, its days written as the config writes them."""
    return {
        TAG_AS_OF: "" if night.as_of is None else config.data.day_label(night.as_of),
        TAG_DAYS: ",".join(config.data.day_label(day) for day in night.lineage_days),
        TAG_PARENT: night.warm_start.version if night.warm_start else "",
        TAG_CHECKPOINT: kept_checkpoint,
        TAG_STATE: state.state_id,
    }


def keep_checkpoint(config: PipelineConfig, checkpoint: str) -> str:
    """Hard-link the run's final checkpoint under `<run_dir>/lineage/` (copied where links
    cannot be made), out of reach of the training folder's retention; returns its path. A
    delta checkpoint is kept with the links of its chain not kept yet, each naming its
    parent's kept copy."""
    folder = config.path("lineage")
    kept: Path | None = None
    for link in chain_of(Path(checkpoint)):
        if link.resolve().parent == folder.resolve():  # a champion's chain a night continued
            kept = link
            continue
        target = folder / f"{link.parent.name}-{link.name}"
        if not (target / META).is_file():
            staging = target.with_name(f".{target.name}.partial")
            shutil.rmtree(staging, ignore_errors=True)
            shutil.copytree(link, staging, copy_function=_link_or_copy)
            if kept is not None:
                _name_parent(staging, os.path.relpath(kept, folder))
            staging.rename(target)
        kept = target
    assert kept is not None, "a chain holds its checkpoint"
    return str(kept)


def _name_parent(checkpoint: Path, parent: str) -> None:
    """Point a kept delta at its parent's kept copy: a new file, not the hard-linked one,
    which the training folder's checkpoint still reads."""
    meta_file = checkpoint / META
    meta = json.loads(meta_file.read_text())
    meta_file.unlink()
    meta_file.write_text(json.dumps({**meta, "parent": parent}))


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def prune_lineage(config: PipelineConfig, client: MlflowClient) -> list[str]:
    """Remove the kept checkpoints of this run folder but the champion's (and the newest
    version's, which `continue_from = "latest"` continues); returns them."""
    folder = config.path("lineage")
    if not folder.is_dir():
        return []
    tagged = {v.tags.get(TAG_CHECKPOINT, "") for v in (current_champion(client, config.tracking.registered_model),
                                                        continued_version(config, client)) if v is not None}  # fmt: skip
    keep = set()
    for checkpoint in filter(None, tagged):
        try:  # a delta's chain, whole
            keep.update(str(link.resolve()) for link in chain_of(Path(checkpoint)))
        except BrokenChain:
            keep.add(str(Path(checkpoint).resolve()))
    removed = []
    for kept in folder.iterdir():
        if kept.is_dir() and str(kept.resolve()) not in keep and not kept.name.startswith("."):
            shutil.rmtree(kept, ignore_errors=True)
            removed.append(str(kept))
    return removed


def skipped_summary(night: Night, client: MlflowClient, config: PipelineConfig) -> SkippedNight:
    """The summary of a night that trains nothing: the version that covers it, and its NE
    on this day when it was judged on it."""
    model_name = config.tracking.registered_model
    version = client.get_model_version(model_name, night.earlier_version) if night.earlier_version else None
    same_day = version is not None and tagged_day(version.tags.get(TAG_AS_OF)) == night.as_of
    eval_ne = client.get_run(version.run_id).data.metrics.get("eval_ne") if same_day and version.run_id else None
    champion = current_champion(client, model_name)
    assert night.as_of is not None, "only a recurring night is skipped"
    return SkippedNight(
        as_of=config.data.shown(night.as_of),
        skip_reason=night.skipped,
        lineage_days=config.data.shown_days(tagged_days(champion.tags.get(TAG_DAYS, "")) if champion else ()),
        eval_ne=eval_ne,
        model_version=night.earlier_version,
        promotion_reason=f"nothing trained: {night.skipped}",
        champion_version=str(champion.version) if champion else None,
    )


TAG_NIGHTS_WITHOUT_PROMOTION = "champion.nights_without_promotion"
TAG_CHAMPION_VERSION = "champion.version"
TAG_CHAMPION_AS_OF = "champion.as_of"


class StaleChampionError(RuntimeError):
    """`orchestration.stale_after_nights` nights in a row without a promotion (on_stale = "fail")."""


@dataclass(frozen=True)
class Staleness:
    """How long the champion has stood: the recurring nights registered since it, none promoted."""

    nights_without_promotion: int
    champion_version: str | None
    champion_as_of: str  # the day it was judged on ("" for a champion of a plain run)
    stale: bool
    message: str


def champion_staleness(config: PipelineConfig, client: MlflowClient) -> Staleness:
    """The nights since the champion was promoted, tagged on the registered model
    (`champion.nights_without_promotion`, `champion.version`, `champion.as_of`); stale when
    they reach `orchestration.stale_after_nights`."""
    name, bound = config.tracking.registered_model, config.orchestration.stale_after_nights
    champion = current_champion(client, name)
    since = int(champion.version) if champion else 0
    nights = [v for v in _versions(client, name) if int(v.version) > since and v.tags.get(TAG_AS_OF)]
    as_of = champion.tags.get(TAG_AS_OF, "") if champion else ""
    for key, value in ((TAG_NIGHTS_WITHOUT_PROMOTION, str(len(nights))),
                       (TAG_CHAMPION_VERSION, str(champion.version) if champion else ""),
                       (TAG_CHAMPION_AS_OF, as_of)):  # fmt: skip
        client.set_registered_model_tag(name, key, value)
    stale = bool(bound) and len(nights) >= bound
    refused = sorted(nights, key=lambda v: int(v.version))[-bound:] if stale else []
    message = (
        f"champion version {champion.version if champion else '(none)'}{f' (judged as of day {as_of})' if as_of else ''} "
        f"has stood for {len(nights)} nights without a promotion, orchestration.stale_after_nights = {bound}: the "
        f"last refusals were {', '.join(f'version {v.version}: ' + v.tags.get('promotion.reason', '?') for v in refused[-3:])}. "
        "Fix what they name, or promote a version by hand (alias 'champion')"
    ) if stale else ""  # fmt: skip
    return Staleness(len(nights), str(champion.version) if champion else None, as_of, stale, message)
