"""Entry point: python -m bov_jax.main --config=configs/d24_bov.py --workdir=DIR

Overrides use ml_collections' flag syntax (--config.train.num_steps=50). Running again with the
same workdir resumes from its latest checkpoint. On a TPU pod, a SLURM allocation, or with
explicit --coordinator_address/--num_processes/--process_id, jax.distributed is initialised
first; each process then reads its own data streams, process 0 alone writes the logs, metrics
and config, and every process writes its shards of each checkpoint. See docs/launch.md.

Exit status: 0 when the run reached its horizon, `train.stop_after_steps` or a SIGTERM/SIGINT
(with a checkpoint); 1 with a one-line reason for a non-finite step, a checkpoint of another
experiment or a damaged checkpoint.
"""

from __future__ import annotations

import logging
import sys

import jax
from absl import app, flags
from ml_collections import config_flags

from bov_jax import xla_flags

config_flags.DEFINE_config_file("config", None, "Experiment config file.", lock_config=True)
flags.DEFINE_string("workdir", None, "Run directory: config, metrics, checkpoints.")
flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-process).")
flags.DEFINE_integer("num_processes", None, "Number of processes (multi-process).")
flags.DEFINE_integer("process_id", None, "This process's index (multi-process).")
flags.DEFINE_list(
    "local_device_ids", None, "Devices of this process, e.g. 0,1,2,3 (one process per GPU node)."
)
flags.DEFINE_integer("local_device_count", None, "CPU only: devices per process.")
flags.DEFINE_integer("initialization_timeout", 300, "Seconds to wait for all processes.")
flags.mark_flags_as_required(["config", "workdir"])
FLAGS = flags.FLAGS

log = logging.getLogger("bov_jax")


def initialize_distributed() -> None:
    """Start jax.distributed when flags or the environment describe several processes.

    Explicit flags win; otherwise TPU pods, SLURM and Open MPI are detected from their
    environment (on SLURM, one process per GPU unless --local_device_ids says otherwise).
    A plain machine runs one process.
    """
    if FLAGS.local_device_count:
        jax.config.update("jax_num_cpu_devices", FLAGS.local_device_count)
    local_ids = [int(i) for i in FLAGS.local_device_ids] if FLAGS.local_device_ids else None
    try:
        jax.distributed.initialize(
            coordinator_address=FLAGS.coordinator_address,
            num_processes=FLAGS.num_processes,
            process_id=FLAGS.process_id,
            local_device_ids=local_ids,
            initialization_timeout=FLAGS.initialization_timeout,
        )
    except ValueError:  # no coordinator given or detected: a single process
        if FLAGS.coordinator_address:
            raise


def configure_logging() -> None:
    """Our lines at INFO on process 0 (WARNING elsewhere); library chatter from WARNING up."""
    count, index = jax.process_count(), jax.process_index()
    prefix = f"[process {index}/{count}] " if count > 1 else ""
    logging.basicConfig(
        level=logging.WARNING,
        format=f"%(asctime)s %(levelname)s {prefix}%(message)s",
        force=True,
    )
    log.setLevel(logging.INFO if index == 0 else logging.WARNING)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    xla_flags.set_gpu_flags()  # before the backend starts
    initialize_distributed()
    configure_logging()
    from bov_jax.train.checkpoint import CheckpointError, ConfigMismatchError
    from bov_jax.train.loop import NonFiniteLossError, run

    try:
        run(FLAGS.config, FLAGS.workdir)
    except (NonFiniteLossError, ConfigMismatchError, CheckpointError) as err:
        log.error("%s: %s", type(err).__name__, err)
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
