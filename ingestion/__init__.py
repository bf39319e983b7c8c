"""Criteo-format logs in, validated Parquet warehouse, DuckDB features and per-rank batches out."""
