"""The model registry's `champion` alias, moved only under a lock (compare-and-set).

Reading the champion, scoring it and moving the alias happen inside one critical section,
so two runs finishing at once are serialised: the second compares itself with whatever
the first left as champion, never with a stale one. The lock lives where the registry
lives: a file lock beside a SQLite store, a PostgreSQL advisory lock for a shared stack.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from evaluation.promotion import (
    PromotionDecision,
    QualityEvidence,
    QualityGate,
    decide_promotion,
    quality_failure,
)
from flows.run.config import ConfigError
from training.locking import exclusive, has_shared_lock

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
    is refused before any comparison; it stays registered, without the alias.
    `champion_ne_on_days` scores the champion on `days`; None means it cannot be scored
    there, and then the candidate is not promoted (no comparison, no promotion).
    """
    refused = evidence is not None and quality_failure(candidate_ne, evidence, gate) is not None
    with lock:
        champion = current_champion(client, model_name)
        if refused or champion is None or str(champion.version) == str(candidate_version):
            decision = decide_promotion(candidate_ne, None, margin, days, evidence=evidence, gate=gate)
        else:
            champion_ne = champion_ne_on_days(champion)
            if champion_ne is None:
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
