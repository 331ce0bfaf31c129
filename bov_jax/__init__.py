"""bov_jax: nanochat-style GPTs with the Bank of Values, in JAX and Flax NNX."""

import flax

from bov_jax.train.platform import skip_absent_tpu

# Parameters carry logical axis names; they are placed on a mesh by the trainer
# (bov_jax.sharding), so creating a model needs no mesh in scope.
flax.config.update("flax_always_shard_variable", False)
skip_absent_tpu()  # before any backend starts: no libtpu probe on a host without a TPU
