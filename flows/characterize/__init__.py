"""Characterization: a batch-size sweep of this hardware's throughput (`measure`), over the
series a sweep names (`sweeps`). Its Prefect flow is a stage's (flows/deployments/characterize.py);
its MLflow run is tracking's (flows/tracking/characterization.py)."""
