"""`python -m bov_jax.analysis values --workdir=RUN [--tokens=N] [--step=S]`.

values: for every layer of the run's checkpoint, on val text, R^2 of the value vectors (and,
as references, the keys and the residual stream) against their mean per token id; written to
RUN/analysis/values_step<N>.json and .png. See bov_jax/analysis/values.py.
"""

from __future__ import annotations

from absl import flags

from bov_jax import cli
from bov_jax.errors import UserError

ANALYSES = ("values",)


def define_flags() -> None:
    """The command's flags (defined on use: other entry points also have a --workdir)."""
    flags.DEFINE_string("workdir", None, "The run's workdir (config.json and checkpoints).")
    flags.DEFINE_integer("tokens", 16384, "Val tokens to measure on (whole batches, >= 1).")
    flags.DEFINE_integer("batch_rows", 8, "Sequences per forward.")
    flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")


def main(argv: list[str]) -> None:
    from bov_jax.analysis.values import analyze_values

    f = flags.FLAGS
    if not f.workdir:
        raise UserError("--workdir=RUN is required")
    if f.tokens <= 0 or f.batch_rows <= 0:
        raise UserError(f"--tokens={f.tokens} --batch_rows={f.batch_rows}; expected > 0")
    path = analyze_values(f.workdir, f.tokens, f.batch_rows, f.step)
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    define_flags()
    cli.run(main, commands=ANALYSES)
