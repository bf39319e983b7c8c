"""Retuning: the hyperparameters stage (look up, port or retune the run's tuning key), the
study and its flow (`retune`), each trial (a real sharded run), and porting tuned values to a
new batch or hardware (`port`)."""
