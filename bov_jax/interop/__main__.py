"""python -m bov_jax.interop import|export: the command line of bov_jax/interop/checkpoints.py.

    python -m bov_jax.interop import --checkpoint_dir=DIR [--step=N] [--tokenizer=PATH] \
        [--data_dir=DIR] --workdir=OUT
    python -m bov_jax.interop export --workdir=RUN [--step=N] --out=DIR
"""

from __future__ import annotations

from absl import flags

from bov_jax import cli
from bov_jax.errors import UserError
from bov_jax.interop.checkpoints import export_checkpoint, import_checkpoint

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The CLI's flags (defined only when run, so that importing this module defines none)."""
    flags.DEFINE_string("checkpoint_dir", None, "import: the authors' checkpoint directory")
    flags.DEFINE_integer("step", None, "checkpoint step (default: the latest)")
    flags.DEFINE_string(
        "tokenizer", None, "import: tokenizer.pkl or .model (default: CHECKPOINT_DIR's)"
    )
    flags.DEFINE_string("data_dir", None, "import: corpus for evals.bpb (default: embedded)")
    flags.DEFINE_string("workdir", None, "import: the workdir to create; export: the run")
    flags.DEFINE_string("out", None, "export: directory for model_*.pt, meta_*.json")


def main(argv: list[str]) -> None:
    if argv[1] == "import":
        if not (FLAGS.checkpoint_dir and FLAGS.workdir):
            raise UserError("import needs --checkpoint_dir and --workdir")
        step = import_checkpoint(
            FLAGS.checkpoint_dir, FLAGS.workdir, FLAGS.step, FLAGS.tokenizer, FLAGS.data_dir
        )
        print(f"imported step {step} of {FLAGS.checkpoint_dir} into {FLAGS.workdir}")
    else:
        if not (FLAGS.workdir and FLAGS.out):
            raise UserError("export needs --workdir and --out")
        print(f"wrote {export_checkpoint(FLAGS.workdir, FLAGS.out, FLAGS.step)}")


if __name__ == "__main__":
    define_flags()
    cli.run(main, commands=("import", "export"))
