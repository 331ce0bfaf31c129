"""Corpus building: fetch packages and shards, extract their text, write ClimbMix-layout shards.

Nothing here runs during training; `bov_jax.data` reads what these builders write.
"""
