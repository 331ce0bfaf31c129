"""Performance tools: `python -m bov_jax.bench train|data` (the train step and the data
pipeline, timed in one process) and the profile breakdown by op category and scope
(`profile`). Decode speed: `python -m bov_jax.inference.bench_decode`."""
