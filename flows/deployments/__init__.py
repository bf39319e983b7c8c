"""What a user deploys and runs: the pipeline and retrain flows (`pipeline`), the
characterization flow (`characterize`), and `dlrm serve`, which serves them as deployments
(`serve`; the retune deployment's flow is flows/tuning/retune.py)."""
