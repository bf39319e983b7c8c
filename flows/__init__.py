"""Prefect flows that wire ingestion, training and evaluation; the `dlrm` command."""
