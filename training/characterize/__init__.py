"""Hardware characterization: batch-size sweeps of short real training jobs (`dlrm characterize`)."""
