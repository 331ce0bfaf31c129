"""Analyses of a trained run's checkpoint: the values analysis (`values`: R^2 of value vectors
against their per-token-id mean). `python -m bov_jax.analysis values`."""
