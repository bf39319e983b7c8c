"""The champion alias on a real MLflow registry (SQLite), moved under real locks."""

import contextlib
import threading
import time
from pathlib import Path

import pytest

from flows.run.config import ConfigError
from flows.tracking.registry import CHAMPION_ALIAS, current_champion, promote_if_better, promotion_lock
from flows.tracking.runs import tracking_client

POSTGRES = "postgresql://postgres@127.0.0.1:5432/postgres"


@pytest.fixture()
def registry(tmp_path: Path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = tracking_client(uri)  # a new store from the migrated template
    client.create_registered_model("ctr")
    versions = [client.create_model_version("ctr", source=str(tmp_path / f"m{i}")).version for i in range(4)]
    return uri, client, [str(v) for v in versions]


def _promote(client, uri, version, ne, ne_of, lock=None):
    return promote_if_better(
        client, "ctr", version, ne, (2,), 0.0,
        champion_ne_on_days=lambda champion: ne_of[str(champion.version)],
        lock=lock if lock is not None else promotion_lock(uri, "", "ctr"),
    )  # fmt: skip


def test_first_then_better_then_worse(registry) -> None:
    uri, client, (v1, v2, v3, _) = registry
    ne_of = {v1: 0.80, v2: 0.79, v3: 0.795}
    assert _promote(client, uri, v1, 0.80, ne_of).promote
    assert _promote(client, uri, v2, 0.79, ne_of).promote
    kept = _promote(client, uri, v3, 0.795, ne_of)
    assert not kept.promote and kept.champion_version == v2 and kept.champion_ne == 0.79
    assert str(current_champion(client, "ctr").version) == v2
    assert client.get_model_version("ctr", v3).tags["promotion.decision"] == "kept champion"


def test_an_unscorable_champion_blocks_promotion(registry) -> None:
    uri, client, (v1, v2, _, _) = registry
    _promote(client, uri, v1, 0.8, {})
    decision = promote_if_better(client, "ctr", v2, 0.1, (2,), 0.0, lambda c: None, promotion_lock(uri, "", "ctr"))
    assert not decision.promote and "cannot be scored" in decision.reason


def _race(client, uri, ne_of, lock_factory, pause):
    """Two candidates finish at once; each reads the champion, scores it slowly, decides."""
    def slow_ne(champion):
        pause()
        return ne_of[str(champion.version)]

    decisions = {}

    def run(version):
        decisions[version] = promote_if_better(client, "ctr", version, ne_of[version], (2,), 0.0, slow_ne, lock_factory())

    threads = [threading.Thread(target=run, args=(v,)) for v in ("2", "3")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return decisions


def test_concurrent_promotions_are_serialised_by_the_lock(registry) -> None:
    uri, client, (v1, v2, v3, _) = registry
    ne_of = {v1: 0.80, v2: 0.78, v3: 0.79}  # both beat the champion; v2 is the best
    _promote(client, uri, v1, 0.80, ne_of)
    decisions = _race(client, uri, ne_of, lambda: promotion_lock(uri, "", "ctr"), lambda: time.sleep(0.3))
    assert str(current_champion(client, "ctr").version) == v2, "the best model ends as champion"
    # Whichever took the lock first compared itself with v1 and was promoted (both beat it);
    # the other then compared itself with that first candidate, not with the stale v1.
    first = [v for v, d in decisions.items() if d.champion_version == v1]
    assert len(first) == 1 and decisions[first[0]].promote
    second = ({v2, v3} - set(first)).pop()
    assert decisions[second].champion_version == first[0]


def test_without_the_lock_both_read_a_stale_champion(registry) -> None:
    uri, client, (v1, v2, v3, _) = registry
    ne_of = {v1: 0.80, v2: 0.78, v3: 0.79}
    _promote(client, uri, v1, 0.80, ne_of)
    barrier = threading.Barrier(2)
    decisions = _race(client, uri, ne_of, contextlib.nullcontext, lambda: barrier.wait(timeout=10))
    assert all(d.champion_version == v1 and d.promote for d in decisions.values()), "the race the lock prevents"


def test_postgres_advisory_lock_is_exclusive() -> None:
    events: list[str] = []
    inside = threading.Event()

    def hold(name: str, seconds: float) -> None:
        with promotion_lock("http://mlflow:5000", POSTGRES, "ctr"):
            events.append(f"{name} in")
            inside.set()
            time.sleep(seconds)
            events.append(f"{name} out")

    first = threading.Thread(target=hold, args=("a", 0.5))
    first.start()
    assert inside.wait(timeout=30), "the first holder took the lock"  # however loaded the machine
    second = threading.Thread(target=hold, args=("b", 0.0))
    second.start()
    first.join()
    second.join()
    assert events == ["a in", "a out", "b in", "b out"]


def test_a_tracking_server_without_a_shared_lock_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="tracking.promotion_lock"):
        promotion_lock("http://mlflow:5000", "", "ctr").__enter__()


def test_alias_name() -> None:
    assert CHAMPION_ALIAS == "champion"


def test_a_refused_candidate_records_the_champions_ne_on_the_same_days(registry) -> None:
    """The quality gate refuses whatever the champion scores, and the decision still says
    what the champion, which keeps serving, scored on those days."""
    from evaluation.promotion import QualityEvidence

    uri, client, (v1, v2, _, _) = registry
    _promote(client, uri, v1, 0.8, {})
    behind_the_regression = QualityEvidence(constant_ne=1.0, reference_ne=0.7, calibration=1.0)
    decision = promote_if_better(client, "ctr", v2, 0.75, (2,), 0.0, lambda champion: 0.8,
                                 promotion_lock(uri, "", "ctr"), evidence=behind_the_regression)  # fmt: skip
    assert not decision.promote and "logistic regression" in decision.reason and decision.champion_ne == 0.8
    assert client.get_model_version("ctr", v2).tags["promotion.decision"] == "refused"
    assert str(current_champion(client, "ctr").version) == v1
    unscorable = promote_if_better(client, "ctr", v2, 0.75, (2,), 0.0, lambda champion: None,
                                   promotion_lock(uri, "", "ctr"), evidence=behind_the_regression)  # fmt: skip
    assert not unscorable.promote and "logistic regression" in unscorable.reason and unscorable.champion_ne is None
