"""Quality metrics as pure functions over summed states: NE, AUC, calibration, log loss."""
