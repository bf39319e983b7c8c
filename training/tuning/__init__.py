"""AutoML retuning: the tuning key, the trigger policy, and the Optuna search."""
