"""Entry point: python -m bov_jax.main --config=configs/d24_bov.py --workdir=DIR

Overrides use ml_collections' flag syntax (--config.train.num_steps=50). On a TPU pod,
a SLURM allocation, or with explicit --coordinator_address/--num_processes/--process_id,
jax.distributed is initialised first; each process then loads its own share of the data.
"""

from __future__ import annotations

import contextlib
import logging

import jax
from absl import app, flags
from ml_collections import config_flags

config_flags.DEFINE_config_file("config", None, "Experiment config file.", lock_config=True)
flags.DEFINE_string("workdir", None, "Run directory: config, metrics, checkpoints.")
flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-process).")
flags.DEFINE_integer("num_processes", None, "Number of processes (multi-process).")
flags.DEFINE_integer("process_id", None, "This process's index (multi-process).")
flags.DEFINE_integer("local_device_count", None, "CPU only: devices per process.")
flags.mark_flags_as_required(["config", "workdir"])
FLAGS = flags.FLAGS


def initialize_distributed() -> None:
    """Start jax.distributed when flags or the environment describe several processes."""
    if FLAGS.local_device_count:
        jax.config.update("jax_num_cpu_devices", FLAGS.local_device_count)
    if FLAGS.coordinator_address:
        jax.distributed.initialize(
            coordinator_address=FLAGS.coordinator_address,
            num_processes=FLAGS.num_processes,
            process_id=FLAGS.process_id,
        )
        return
    # TPU pods, SLURM and Open MPI are detected from their environment; else one process.
    with contextlib.suppress(ValueError, RuntimeError):
        jax.distributed.initialize()


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    # Our own log lines at INFO; library chatter (orbax, absl) only from WARNING up.
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s", force=True
    )
    logging.getLogger("bov_jax").setLevel(logging.INFO)
    initialize_distributed()
    from bov_jax.train.loop import run

    run(FLAGS.config, FLAGS.workdir)


if __name__ == "__main__":
    app.run(main)
