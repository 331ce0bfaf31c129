"""The README's default job: a small BoV model on the embedded corpus, minutes on 2 CPU cores.

Depth 4, width 256 (two heads of 128), sequence 512, the 8192-token sentencepiece model
shipped with the embedded corpus, BoV (a bank and a learned gamma) in layers 2 and 3.
The reference scales learning rates by sqrt(batch / 2**19); at this tiny batch that would
stall learning, so the reference batch is set to this run's batch (scale 1).
"""

from bov_jax.presets import config_for


def get_config():
    config = config_for("d12_bov")
    config.name = "quickstart"
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
    config.optim.warmup_steps = 20
    config.checkpoint.save_every = 50
    return config
