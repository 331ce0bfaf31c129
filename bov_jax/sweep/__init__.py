"""Sweeps: a sweep file's runs x seeds expanded into workdirs (`jobs`) and handed to an
engine (here, a SLURM array, the TPU pod launcher). `python -m bov_jax.sweep`. Nothing in the
trainer imports this package."""
