"""Orchestration on top of the stages: config schema and overrides, CLI, sweeps on Ray Tune, MLflow tracking."""
