"""The README's default job: a small BoV model on the embedded corpus, minutes on 2 CPU cores.

Depth 4, width 256 (two heads of 128), sequence 512, the 8192-token sentencepiece model
shipped with the embedded corpus, BoV (a bank and a learned gamma) in layers 2 and 3.
The reference scales learning rates by sqrt(batch / 2**19) and Muon's weight decay by the
data ratio to its d12 anchor; at this tiny size the first would stall learning and the
second would give a decay of about 5, so the reference batch is this run's batch (LR scale 1)
and the weight decay is the d12 value, unscaled.
"""

from bov_jax.presets import config_for


def get_config(preset: str = "d12_bov"):
    """configs/quickstart.py[:<preset>]: the quickstart model with another preset's value
    path, e.g. configs/quickstart.py:d12 for the baseline."""
    config = config_for(preset)
    config.name = f"quickstart_{preset}"
    m = config.model
    m.depth = 4
    m.model_dim = 256
    m.vocab_size = 8192
    m.seq_len = 512
    t = config.train
    t.target_flops = -1.0
    t.num_steps = 200
    t.total_batch_tokens = 8 * 512
    t.device_batch_size = 8
    t.log_every = 10
    t.eval_every = 50
    t.eval_tokens = 32 * 512
    t.sample_every = 100
    config.optim.reference_batch_tokens = t.total_batch_tokens
    config.optim.scale_weight_decay = False
    config.optim.warmup_steps = 20
    config.checkpoint.save_every = 50
    # The corpus' documents are chapters and addresses, far longer than a 512-token row:
    # the reference packing would crop ~65% of the tokens away, so long documents are cut
    # into BOS-prefixed pieces of at most one row instead.
    config.data.max_doc_tokens = m.seq_len + 1
    return config
