"""Experiments on top of the trainer: sweeps (runs x seeds -> workdirs -> an engine), reports
and analyses that only read workdirs. Nothing in the trainer imports this package."""
