"""The data benchmark on the quickstart setting: the embedded corpus at seq_len 512."""

from bov_jax.data.bench import measure_pipeline
from bov_jax.data.config import default_data_config

# The quickstart trainer (depth 4, width 256, seq 512, 2 CPU cores) consumes 10-30k tokens/s.
QUICKSTART_TOKENS_PER_SEC = 30_000


def test_pipeline_outpaces_the_quickstart_trainer_fivefold(tmp_path):
    cfg = default_data_config()
    cfg.cache_dir = str(tmp_path)  # a fresh token cache, built by the first batch
    rate = measure_pipeline(cfg, seq_len=512, batch_size=32, seconds=1.0, num_workers=0)
    print(f"\nembedded corpus, token cache, no workers: {rate:,.0f} tokens/s")
    assert rate >= 5 * QUICKSTART_TOKENS_PER_SEC
