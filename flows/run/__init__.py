"""A run, as data: the config, where its days are, what a night trains, the resolved run, the
rows it trains on, the job it launches and what it reports. Pure: neither Prefect nor MLflow
is imported here (tests/unit/flows/test_layers.py), so every way into training (the
pipeline, `dlrm train`, a trial, characterization) builds the same job from the same code."""
