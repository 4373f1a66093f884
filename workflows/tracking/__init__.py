"""Experiment tracking in MLflow: client.py (fail-soft client, used on the driver and on workers),
session.py (the driver's experiment and run tree), stages.py (what each stage logs),
commands.py (`workflows runs` and `workflows ui`)."""
