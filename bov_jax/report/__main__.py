"""`python -m bov_jax.report --root=DIR [--out=DIR]` or `--workdir=RUN [--out=DIR]`.

Writes report.md and figures/*.png for a sweep root (what ran, tables in the paper's layout
over seeds, paired differences to the baseline and their figure, val BPB curves, learned
coefficients, the cache-memory figure) or for one run (curves and coefficients; its final BPB
from evals/bpb_step<N>.json where the run has one). See bov_jax/report/markdown.py.
"""

from __future__ import annotations

from absl import flags

from bov_jax import cli
from bov_jax.errors import UserError


def define_flags() -> None:
    """The command's flags (defined on use: other entry points also have a --workdir)."""
    flags.DEFINE_string("root", None, "Sweep root: sweep.json and <run>/seed<k>/ workdirs.")
    flags.DEFINE_string("workdir", None, "One run's workdir (instead of --root).")
    flags.DEFINE_string("out", None, "Output directory (default: the root or the workdir).")
    flags.DEFINE_bool("kv_cache", True, "Also draw figures/kv_cache.png (Fig. 5a).")


def main(argv: list[str]) -> None:
    from bov_jax.report.markdown import write_report
    from bov_jax.report.runs import load_sweep, single_run

    f = flags.FLAGS
    if (f.root is None) == (f.workdir is None):
        raise UserError("give exactly one of --root=DIR (a sweep) or --workdir=RUN (a run)")
    sweep = load_sweep(f.root) if f.root else single_run(f.workdir)
    out = f.out or f.root or f.workdir
    path = write_report(sweep, out, with_kv_cache=f.kv_cache and bool(f.root))
    print(f"wrote {path}")


if __name__ == "__main__":
    define_flags()
    cli.run(main)
