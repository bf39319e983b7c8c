"""The pipeline's Prefect stages: features (ingest and preprocess), training (on this host or
every trainer host, one trainer slot at a time), calibration and evaluation; and the Prefect
plumbing every flow shares (the local server, its defaults, what a stopped run cancels)."""
