"""Entry point: python -m bov_jax.main --config=configs/d24_bov.py --workdir=DIR

Overrides use ml_collections' flag syntax (--config.train.num_steps=50); `--show_config`
lists every key with its default and meaning. A config file may take a preset after a colon
(--config=configs/ablations.py:d12_bank; `python -m bov_jax.presets` lists them). Running
again with the same workdir resumes from its latest checkpoint. On a TPU pod, a SLURM
allocation, or with explicit --coordinator_address/--num_processes/--process_id,
jax.distributed is initialised first; each process then reads its own data streams, process
0 alone writes the logs, metrics and config, and every process writes its shards of each
checkpoint. A process that dies is noticed by the others within --peer_timeout seconds
(bov_jax/train/peers.py), which then stop with one line. See docs/launch.md.

Exit status: 0 when the run reached its horizon, `train.stop_after_steps` or a SIGTERM/SIGINT
(with a checkpoint); 1 with a one-line reason for a non-finite step, a checkpoint of another
experiment or other data, a damaged shard or checkpoint, a dead peer process or a failed save; 2
for a bad flag, config key or value, input file or an unwritable workdir (see bov_jax/cli.py;
--debug shows tracebacks).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import jax
from absl import flags

from bov_jax import cli
from bov_jax.config import check_config_arguments, define_config_flag, describe_keys
from bov_jax.errors import UserError
from bov_jax.prepare import check_prepared
from bov_jax.train import host_memory, peers, xla_flags

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command's flags (defined on use: other entry points also have a --workdir)."""
    define_config_flag()
    flags.DEFINE_string("workdir", None, "Run directory: config, metrics, checkpoints.")
    flags.DEFINE_bool(
        "show_config",
        False,
        "Print every config key with its value and meaning, then exit: the resolved --config "
        "with its overrides, or the schema's defaults without --config.",
    )
    flags.DEFINE_enum(
        "check_platform",
        None,
        ["cpu", "gpu", "tpu"],
        "Check that jax runs on this platform, print its devices and exit (2 if not): job "
        "scripts run it before starting the processes.",
    )
    flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-process).")
    flags.DEFINE_integer("num_processes", None, "Number of processes (multi-process).")
    flags.DEFINE_integer("process_id", None, "This process's index (multi-process).")
    flags.DEFINE_list(
        "local_device_ids",
        None,
        "Devices of this process, e.g. 0,1,2,3 (one process per GPU node).",
    )
    flags.DEFINE_integer("local_device_count", None, "CPU only: devices per process.")
    flags.DEFINE_integer("initialization_timeout", 300, "Seconds to wait for all processes.")
    flags.DEFINE_integer(
        "peer_timeout",
        peers.DEFAULT_TIMEOUT_SECONDS,
        "Multi-process: seconds without another process's heartbeat before this one stops with "
        "one line (0: wait for jax.distributed's own timeout).",
    )


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


def drop_library_tracebacks(record: logging.LogRecord) -> bool:
    """Drop library log records (Orbax's, through absl) that carry a traceback: the failure
    they log reaches us as an exception, which cli.run reports in one line."""
    return record.exc_info is None


def configure_logging() -> None:
    """Our lines at INFO on process 0 (WARNING elsewhere); library chatter from WARNING up,
    without tracebacks unless --debug."""
    count, index = jax.process_count(), jax.process_index()
    prefix = f"[process {index}/{count}] " if count > 1 else ""
    logging.basicConfig(
        level=logging.WARNING,
        format=f"%(asctime)s %(levelname)s {prefix}%(message)s",
        force=True,
    )
    log.setLevel(logging.INFO if index == 0 else logging.WARNING)
    if not cli.debug_enabled():
        logging.getLogger("absl").addFilter(drop_library_tracebacks)
        quiet_background_writers()


def quiet_background_writers() -> None:
    """Keep the echoes of a failed background save off stderr (the failure itself reaches the
    loop as an exception, which cli.run reports in one line).

    When one of Orbax's asynchronous writes fails (a full disk), its event loop closes while
    TensorStore still completes the other writes: each completion calls the closed loop and is
    printed as an unraisable `RuntimeError: Event loop is closed`, and asyncio logs the
    gathered futures whose exception nobody retrieved. Both are dropped (`--debug` keeps them);
    any other unraisable error is printed as usual.
    """
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    default = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        value = unraisable.exc_value
        if isinstance(value, RuntimeError) and str(value) == "Event loop is closed":
            return
        default(unraisable)

    sys.unraisablehook = hook


def show_config() -> None:
    """Every key as `key = value  # meaning` (the comments of bov_jax/config.py): of --config
    with its overrides when given, else of the schema's defaults."""
    for key, value, doc in describe_keys(FLAGS.config):
        print(f"{key} = {value!r}" + (f"  # {doc}" if doc else ""))


def main(argv: list[str]) -> None:
    if FLAGS.show_config:
        show_config()
        return
    if FLAGS.check_platform:
        from bov_jax.train.platform import check_platform

        print(check_platform(FLAGS.check_platform))
        return
    for name in ("config", "workdir"):
        if not FLAGS[name].present:
            raise UserError(f"--{name} is required (--help explains the flags)")
    check_prepared(FLAGS.config, sys.argv[1:])  # a paper config on unprepared data: say how
    xla_flags.set_gpu_flags()  # before the backend starts
    host_memory.reuse_freed_memory_on_cpu()  # before the backend starts
    initialize_distributed()
    configure_logging()
    from bov_jax.train.loop import run

    watch = peers.watch_peers(FLAGS.peer_timeout)
    if watch is None:
        run(FLAGS.config, FLAGS.workdir)
        return
    try:
        run(FLAGS.config, FLAGS.workdir)
    except BaseException as err:
        if not isinstance(err, UserError | KeyboardInterrupt):
            watch.await_verdict()  # a collective failed: a dead peer is the likely cause
        watch.finish(peers.FAILED)  # the others stop at once, pointing to this log
        cli.exit_now(err, cli.debug_enabled())  # not waiting at exit for peers that leave
    watch.finish(peers.DONE)


if __name__ == "__main__":
    define_flags()
    cli.run(main, check_argv=check_config_arguments)
