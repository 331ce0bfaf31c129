"""`python -m bov_jax.probes <probe> [flags]`: recall and long-context probes.

mqar        --workdir=RUN: held-out MQAR accuracy of a run trained with data.source="mqar"
            (RUN/probes/mqar.json).
mqar_sweep  --root=DIR[,DIR] --out=OUT: scores every finished job of an MQAR sweep
            (configs/sweeps/recall_cpu.py) and writes OUT/mqar.md, mqar.png, mqar_scores.json.
lm          --workdir=RUN: a language-model run's loss by position over val documents longer
            than the context, induction accuracy by span and distance, and passkey retrieval
            through the serving engine on a grid of context x depth (RUN/probes/lm_step<N>.json).
lm_sweep    --root=DIR --out=OUT [--baseline=d12]: the lm probes of every finished job of a
            language-model sweep, paired by seed with the baseline run (OUT/lm_probes.md, .png,
            .json).
"""

from __future__ import annotations

from absl import flags

from bov_jax import cli
from bov_jax.errors import UserError

PROBES = ("mqar", "mqar_sweep", "lm", "lm_sweep")


def define_flags() -> None:
    """The command's flags (defined on use: other entry points also have a --workdir)."""
    flags.DEFINE_string("workdir", None, "A run's workdir (config.json and checkpoints).")
    flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
    flags.DEFINE_list(
        "root", [], "mqar_sweep (several, comma-separated), lm_sweep: the sweep's directory."
    )
    flags.DEFINE_string("out", None, "mqar_sweep, lm_sweep: where the tables and figures go.")
    flags.DEFINE_string("baseline", "d12", "lm_sweep: the run the others are paired with.")
    flags.DEFINE_integer("documents", 64, "lm: val documents longer than the context.")
    flags.DEFINE_integer("rows", 32, "lm: induction sequences per (span, distance).")
    flags.DEFINE_integer("trials", 8, "lm: passkey prompts per (context, depth).")


def main(argv: list[str]) -> None:
    f = flags.FLAGS
    probe = argv[1]
    cli.quiet_libraries()  # no Orbax INFO line per restored checkpoint
    if probe == "mqar_sweep":
        from bov_jax.probes.mqar_sweep import report

        if not f.root or not f.out:
            raise UserError("mqar_sweep needs --root=DIR and --out=OUT")
        for path in report(f.root, f.out):
            print(f"wrote {path}")
        return
    if min(f.documents, f.rows, f.trials) <= 0:
        raise UserError(f"--documents={f.documents} --rows={f.rows} --trials={f.trials}; need > 0")
    if probe == "lm_sweep":
        from bov_jax.probes.lm_sweep import report as lm_report

        if len(f.root) != 1 or not f.out:
            raise UserError("lm_sweep needs one --root=DIR and --out=OUT")
        for path in lm_report(f.root[0], f.out, f.baseline, f.documents, f.rows, f.trials):
            print(f"wrote {path}")
        return
    if not f.workdir:
        raise UserError(f"{probe} needs --workdir=RUN")
    if probe == "mqar":
        from bov_jax.probes.mqar import probe_run

        print(f"wrote {probe_run(f.workdir, f.step)}")
        return
    from bov_jax.probes.lm import probe_run as lm_probe

    print(f"wrote {lm_probe(f.workdir, f.step, f.documents, f.rows, f.trials)}")


if __name__ == "__main__":
    define_flags()
    cli.run(main, commands=PROBES)
