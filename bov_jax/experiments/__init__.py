"""Experiments on top of training: reports and analyses that only read run workdirs.

Nothing in the trainer imports this package.
"""
