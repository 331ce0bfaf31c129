"""The data benchmark's measurement function on the quickstart setting (speed itself is
measured by `python -m bov_jax.bench data`, never asserted in a test)."""

from bov_jax.data.bench import measure_pipeline
from bov_jax.data.config import default_data_config


def test_measure_pipeline_reads_whole_batches(tmp_path):
    cfg = default_data_config()
    cfg.cache_dir = str(tmp_path)  # a fresh token cache, built by the first batch
    rate = measure_pipeline(cfg, seq_len=512, batch_size=4, seconds=0.2, num_workers=0)
    assert rate > 0
    assert any(tmp_path.iterdir())  # the cache was built where the config points
