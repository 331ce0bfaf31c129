"""MQAR (Zoology's multi-query associative recall) for any value path, on CPU in a minute.

Depth 3 (the "last third" is layer 2), width 64 (heads of 32), full attention over rows of
256 tokens, the 257 ids of the byte-level tokenizer data/mqar/tokenizer.pkl (keys, values and
fillers are bov_jax/data/mqar.py's id ranges within it). Loss and val BPB count the answers
only; held-out accuracy comes from `python -m bov_jax.probes mqar --workdir=...`.

  python -m bov_jax.main --config=configs/mqar.py:d12_bov --workdir=runs/mqar_bov \
      --config.data.mqar.num_pairs=32 --config.model.model_dim=256
"""

from bov_jax.presets import config_for


def get_config(preset: str = "d12_bov"):
    """configs/mqar.py[:<preset>]: the MQAR model with that preset's value path."""
    config = config_for(preset)
    config.name = f"mqar_{preset}"
    m = config.model
    m.depth = 3
    m.model_dim = 64
    m.head_dim = 32
    m.vocab_size = 257
    m.seq_len = 256
    m.window_pattern = "L"
    d = config.data
    d.source = "mqar"
    d.mqar.num_pairs = 8
    d.use_cache = False  # the corpus is not read
    t = config.train
    t.target_flops = -1.0
    t.num_steps = 300
    t.total_batch_tokens = 8 * m.seq_len
    t.device_batch_size = 8
    t.log_every = 50
    t.eval_every = t.num_steps
    t.eval_tokens = 8 * m.seq_len  # val BPB of the answers; accuracy: bov_jax.probes mqar
    t.sample_tokens = 0
    o = config.optim
    o.reference_batch_tokens = t.total_batch_tokens
    o.scale_weight_decay = False
    o.weight_decay = 0.0
    o.warmup_steps = 20
    config.checkpoint.save_every = 0
    return config
