"""Inference: everything about decoding and serving a trained model, over `bov_jax.model`.

decode.py (the dense cache and `generate`), attention.py (attention over that cache),
bank_gather.py (a decoding step's bank rows in one GPU kernel), texts.py (text completions),
memory.py (KV/bank cache memory against Eq. 6), bench_decode.py and sample.py (commands).
"""
