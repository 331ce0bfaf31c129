"""Cache memory measured from the arrays, against the paper's Eq. 6."""

import jax
import jax.numpy as jnp
import pytest
from helpers import tiny_config

from bov_jax.inference import decode, memory
from bov_jax.inference.layout import CacheLayout
from bov_jax.model.spec import ModelSpec
from bov_jax.presets import config_for


def spec_of(name: str) -> ModelSpec:
    return ModelSpec.from_config(config_for(name).model)


@pytest.mark.parametrize("batch, context", [(1, 4096), (2, 65536), (1, 2**20)])
def test_d24_bov_memory_matches_eq6_in_elements(batch, context):
    """Compared, all in elements and for the d24 BoV layout (L = 24, d = K = 1536):
    (V of the cache with a V cache in every layer) − (V of the cache without V in the
    BoV layers) − (elements of the 8 banks) == (L/3) · d · (B·T − |V|), |V| = 32768.
    """
    spec = spec_of("d24_bov")
    r = memory.memory_report(spec, batch, context)
    L, d, vocab = 24, 1536, 32768
    assert (spec.n_layer, spec.kv_dim, spec.padded_vocab, len(spec.targets)) == (L, d, vocab, 8)
    eq6 = (L // 3) * d * (batch * context - vocab)
    assert r.eq6.elements == eq6
    assert r.eq6_measured == eq6
    assert (r.with_v.v - r.without_v.v).elements == (L // 3) * d * batch * context
    assert r.bank.elements == (L // 3) * vocab * d
    assert r.with_v.k == r.without_v.k
    assert r.without_v.token_ids.elements == batch * context
    assert r.with_v.token_ids.elements == 0
    assert r.saved.bytes == (L // 3) * d * batch * context * 2 - 4 * batch * context  # bf16, int32
    assert r.eq6.bytes == 2 * eq6
    assert r.eq6.fraction == pytest.approx((1 / 6) * (1 - vocab / (batch * context)))


def test_bov_cache_with_v_has_the_baseline_layout():
    base = memory.cache_size(spec_of("d24"), 1, 8192, eliminate_bank_v=True)
    bov = memory.cache_size(spec_of("d24_bov"), 1, 8192, eliminate_bank_v=False)
    assert base == bov


def test_fig5a_check_values():
    spec = spec_of("d24_bov")
    for context, percent in [(2**16, 8.3), (2**18, 14.6), (2**20, 16.1)]:
        assert round(100 * memory.eq6(spec, 1, context).fraction, 1) == percent
    assert memory.eq6(spec, 1, 32768).elements == 0


def test_shared_bank_is_held_once_unlike_eq6():
    spec = ModelSpec.from_config(tiny_config("d12_bov_shared").model)
    r = memory.memory_report(spec, 2, 64, jnp.float32)
    n_t, k, vocab = len(spec.targets), spec.kv_dim, spec.padded_vocab
    assert r.bank.elements == vocab * k
    assert r.eq6_measured - r.eq6.elements == (n_t - 1) * vocab * k


@pytest.mark.parametrize(
    "preset, eliminate", [("d12_bov", True), ("d12_bov", False), ("d12", True)]
)
def test_cache_bytes_are_those_of_the_allocated_cache(preset, eliminate):
    spec = ModelSpec.from_config(tiny_config(preset).model)
    cache = decode.init_cache(spec, 3, 40, jnp.bfloat16, eliminate)
    allocated = sum(x.nbytes for x in jax.tree.leaves(cache))
    assert memory.kv_cache_bytes(spec, 3, 40, jnp.bfloat16, eliminate) == allocated


def test_write_docs(tmp_path):
    path = tmp_path / "kv_memory.md"
    memory.write_docs(config_for("d24_bov"), "configs/d24_bov.py", path)
    text = path.read_text()
    assert "## |V| = 32,768" in text and "## |V| = 151,936" in text
    assert text.count("| 1M |") == 2 and "| 64K |" in text


@pytest.mark.parametrize("preset", ["d24_bov", "d12_bov", "d12_bov_shared"])
def test_paged_bytes_per_cached_token_save_eq6s_per_token_figure(preset):
    """The paged layout's bytes per cached token: with a V pool in every layer minus without
    V pools in the BoV layers = Eq. 6's n_t · K elements a token, less the 4-byte token id
    the id pages hold (which Eq. 6 leaves out); with V pools it is the baseline's layout."""
    spec = spec_of(preset)
    for dtype in (jnp.bfloat16, jnp.float32):
        without = CacheLayout.build(spec, 16, dtype)
        with_v = CacheLayout.build(spec, 16, dtype, eliminate_bank_v=False)
        eq6 = memory.eq6(spec, 1, 4096, dtype)
        assert eq6.per_token == len(spec.targets) * spec.kv_dim
        itemsize = jnp.dtype(dtype).itemsize
        assert with_v.bytes_per_token - without.bytes_per_token == eq6.per_token * itemsize - 4
        assert with_v.bytes_per_token == 2 * spec.n_layer * spec.kv_dim * itemsize
