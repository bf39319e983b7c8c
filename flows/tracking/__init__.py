"""MLflow: a run's parameters, metrics, plots and artifacts (`runs`), the registry and its
champion alias (`registry`), the lineage of recurring versions (`lineage`), logging that
waits for an unreachable server (`deferred`), and characterization's runs
(`characterization`). Nothing here imports Prefect (tests/unit/flows/test_layers.py)."""
