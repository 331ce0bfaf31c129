"""Ahead-of-time compilation of the training steps for target hardware this host lacks.

`python -m bov_jax.compile --config=CONFIG --target=v5p-8` (see __main__.py): targets.py names
the TPU slices and NVIDIA GPUs and describes their devices, aot.py builds the loop's state
and steps abstractly and compiles them, hlo.py reads memory-relevant facts off the compiled
program, report.py assembles one report. docs/targets.md has the figures for the headline
configs.
"""
