"""The model registry's `champion` alias, moved only under a lock (compare-and-set).

Reading the champion, scoring it and moving the alias happen inside one critical section,
so two runs finishing at once are serialised: the second compares itself with whatever
the first left as champion, never with a stale one. The lock lives where the registry
lives: a file lock beside a SQLite store, a PostgreSQL advisory lock for a shared stack.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import mlflow
import torch
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from evaluation.calibration import Calibrator
from evaluation.promotion import (
    PromotionDecision,
    QualityEvidence,
    QualityGate,
    decide_promotion,
    quality_failure,
)
from flows.run.config import ConfigError
from training.locking import exclusive, has_shared_lock
from training.serving.scoring import LogitFn, dlrm_logits

CHAMPION_ALIAS = "champion"
DEFAULT_GATE = QualityGate()


@contextlib.contextmanager
def promotion_lock(tracking_uri: str, lock_uri: str, model_name: str) -> Iterator[None]:
    """Exclusive per registered model, across processes and hosts sharing the store."""
    target = lock_uri or tracking_uri
    if not has_shared_lock(target):
        raise ConfigError(
            f"tracking.promotion_lock: promotions through {target.split('://')[0]}:// need a shared lock; "
            "set it to the postgresql:// URL of a database every trainer can reach"
        )
    with exclusive(target, f"{model_name}.promotion"):
        yield


def current_champion(client: MlflowClient, model_name: str) -> ModelVersion | None:
    try:
        return client.get_model_version_by_alias(model_name, CHAMPION_ALIAS)
    except MlflowException:
        return None


def promote_if_better(
    client: MlflowClient,
    model_name: str,
    candidate_version: str,
    candidate_ne: float,
    days: tuple[int | str, ...],
    margin: float,
    champion_ne_on_days: Callable[[ModelVersion], float | None],
    lock: contextlib.AbstractContextManager,
    evidence: QualityEvidence | None = None,
    gate: QualityGate = DEFAULT_GATE,
) -> PromotionDecision:
    """Compare with the champion on the same days and move the alias, all under `lock`.

    A candidate that fails the quality gate (`evidence`: its references on the same rows)
    is refused whatever the champion scores; it stays registered, without the alias, and
    the decision still records the champion's NE on the same days (what kept serving them).
    `champion_ne_on_days` scores the champion on `days`; None means it cannot be scored
    there, and then the candidate is not promoted (no comparison, no promotion).
    """
    refused = evidence is not None and quality_failure(candidate_ne, evidence, gate) is not None
    with lock:
        champion = current_champion(client, model_name)
        if champion is None or str(champion.version) == str(candidate_version):
            decision = decide_promotion(candidate_ne, None, margin, days, evidence=evidence, gate=gate)
        else:
            champion_ne = champion_ne_on_days(champion)
            if champion_ne is None and not refused:
                decision = PromotionDecision(
                    False, f"champion version {champion.version} cannot be scored on days {list(days)}",
                    candidate_ne, None, margin, days, str(champion.version),
                )  # fmt: skip
            else:
                decision = decide_promotion(candidate_ne, champion_ne, margin, days, str(champion.version),
                                            evidence=evidence, gate=gate)  # fmt: skip
        if decision.promote:
            client.set_registered_model_alias(model_name, CHAMPION_ALIAS, candidate_version)
        client.set_model_version_tag(model_name, candidate_version, "promotion.decision", decision_tag(decision, refused))
        client.set_model_version_tag(model_name, candidate_version, "promotion.reason", decision.reason)
    return decision


def decision_tag(decision: PromotionDecision, refused: bool) -> str:
    """"promoted", "refused" (failed the quality gate) or "kept champion"."""
    return "promoted" if decision.promote else "refused" if refused else "kept champion"


def record_promotion(client: MlflowClient, run_id: str, decision: PromotionDecision, refused: bool) -> None:
    """The decision on the candidate's run: its JSON, the decision and reason as tags, and the
    champion's NE on the same days when there was one."""
    client.log_dict(run_id, decision.as_dict(), "promotion/decision.json")
    client.set_tag(run_id, "promotion.decision", decision_tag(decision, refused))
    client.set_tag(run_id, "promotion.reason", decision.reason)
    if decision.champion_ne is not None:
        client.log_metric(run_id, "champion_ne_same_days", decision.champion_ne)


def registered_dlrm(model_uri: str) -> torch.nn.Module:
    """The DLRM of a registered version, on CPU: inside this project's pyfunc, or the module
    itself for versions logged before it (the `pytorch` flavour)."""
    return registered_scorer(model_uri)[0]


def registered_scorer(model_uri: str, tracking_uri: str | None = None) -> tuple[torch.nn.Module, Calibrator, LogitFn]:
    """The DLRM of a registered version, on CPU, the calibrator it serves with (the identity
    for versions logged before calibration, and for the `pytorch` flavour), and its logits of
    feature files' batches (managed ids remapped as it serves). `tracking_uri`: the registry's
    (default: the current one)."""
    if tracking_uri is not None:
        mlflow.set_tracking_uri(tracking_uri)
    if "pytorch" in mlflow.models.get_model_info(model_uri).flavors:
        model = mlflow.pytorch.load_model(model_uri, map_location="cpu")
        return model, Calibrator(), dlrm_logits(model)
    served = mlflow.pyfunc.load_model(model_uri).unwrap_python_model()
    model = served.dlrm.cpu()
    return model, Calibrator.from_dict(served.calibrator.as_dict()), dlrm_logits(model, _served_rows(served.features))


def _served_rows(features: Any) -> Callable[[KeyedJaggedTensor, torch.Tensor], KeyedJaggedTensor] | None:
    """A served version's rows of feature files' batches, with the version's own code: versions
    logged before managed ids serve rows as the features hold them (None), those before count
    bins take the ids alone."""
    feature_rows = getattr(features, "feature_rows", None)
    if feature_rows is None:
        return None
    if not getattr(features, "count_bins", ()):
        return lambda sparse, dense: feature_rows(sparse)
    return lambda sparse, dense: features.with_count_bins(feature_rows(sparse), dense.cpu().numpy())
