"""`python -m bov_jax.bench train` on a tiny config: every reported field, the JSON file, the
parts within the whole."""

import json

import pytest

from bov_jax.bench import __main__ as bench

TINY_CONFIG = """
import jax

from bov_jax.presets import config_for


def get_config(preset="d12_bov"):
    config = config_for(preset)
    config.model.update(depth=2, model_dim=64, head_dim=32, vocab_size=512, seq_len=32,
                        short_window=8)
    config.train.device_batch_size = 1
    # three micro-batches of one row per device
    config.train.total_batch_tokens = 3 * jax.device_count() * 32
    return config
"""

FIELDS = (
    "micro_batches",
    "step_ms",
    "gradients_ms",
    "optimizer_ms",
    "fwd_bwd_ms_per_micro_batch",
    "tokens_per_sec",
    "mfu_fwd_bwd",
    "mfu_step",
    "peak_memory_gib",
    "halves_over_step",
    "halves_over_step_of_min_times",
    "step_time_ratio_vs_first",
)


def test_bench_train_reports_every_field_for_both_configs(
    tmp_path, capsys, command_flags, monkeypatch
):
    # In the test's own process: leave its malloc settings alone (bov_jax/train/host_memory.py).
    monkeypatch.setenv("BOV_HOST_MALLOC", "0")
    config = tmp_path / "tiny.py"
    config.write_text(TINY_CONFIG)
    out = tmp_path / "bench.json"
    command_flags(
        bench.define_flags,
        f"--configs={config}:d12,{config}",
        "--steps=3",
        "--reps=5",
        f"--json_out={out}",
    )
    bench.main(["bench", "train"])
    results = json.loads(out.read_text())
    assert [r["config"] for r in results] == [f"{config}:d12", str(config)]
    for r in results:
        for field in FIELDS:
            assert field in r, field
        assert r["micro_batches"] == 3  # what the config's total batch needs
        assert r["token_ids"] == "corpus"
        assert r["step_ms"] > 0 and r["optimizer_ms"] > 0 and r["fwd_bwd_ms_per_micro_batch"] > 0
        assert r["mfu_step"] is None and r["mfu_fwd_bwd"] is None  # no known peak on CPU
        assert r["peak_memory_gib"] > 0
        assert len(r["step_ms_reps"]) == 5
        # The parts are the step's own halves: each shorter than the step, and together the
        # step within 40% (minimum times over the rounds: the machine is shared).
        fastest_step = min(r["step_ms_reps"])
        assert r["gradients_ms_min"] < fastest_step and r["optimizer_ms_min"] < fastest_step
        assert 0.6 < r["halves_over_step_of_min_times"] < 1.4
    assert results[0]["step_time_ratio_vs_first"]["median"] == 1.0
    printed = capsys.readouterr().out
    assert f"{config}:d12" in printed and "ratio" in printed


def test_gpu_flags_keep_flags_already_given():
    from bov_jax.train.xla_flags import GPU_FLAGS, set_gpu_flags, with_gpu_flags

    given = "--xla_gpu_enable_triton_gemm=true --xla_dump_to=/tmp/x"
    merged = with_gpu_flags(given).split()
    assert merged[:2] == given.split()
    assert "--xla_gpu_enable_triton_gemm=false" not in merged
    assert set(GPU_FLAGS[:2]) <= set(merged)
    environ = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": given}
    set_gpu_flags(environ)  # not a GPU platform: unchanged
    assert environ["XLA_FLAGS"] == given


def test_profiling_turns_gpu_command_buffers_off(monkeypatch):
    """A profile on a GPU traces each op only without command buffers (CUDA graphs)."""
    from bov_jax.train import xla_flags

    monkeypatch.setattr(xla_flags.os.path, "exists", lambda path: path == "/dev/nvidiactl")
    for switch in ("1", "0"):
        environ = {"BOV_XLA_GPU_FLAGS": switch}
        xla_flags.set_gpu_flags(environ, profiling=True)
        flags = environ["XLA_FLAGS"].split()
        assert xla_flags.NO_COMMAND_BUFFERS in flags
        assert not [f for f in flags if f.startswith("--xla_gpu_enable_command_buffer=F")]
        assert ("--xla_gpu_enable_triton_gemm=false" in flags) == (switch == "1")
        environ = {"BOV_XLA_GPU_FLAGS": switch}
        xla_flags.set_gpu_flags(environ)
        assert xla_flags.NO_COMMAND_BUFFERS not in environ.get("XLA_FLAGS", "").split()


def test_profile_times_ops_by_category_and_scope(tmp_path):
    import jax
    import jax.numpy as jnp

    from bov_jax.bench import profile

    @jax.jit
    def f(x, w, ids):
        with jax.named_scope("mlp"):
            y = jnp.tanh(x @ w)
        with jax.named_scope("bank"):
            rows = jnp.take(w, ids, axis=0)
        return (y @ w.T).sum() + rows.sum()

    args = (jnp.ones((256, 256)), jnp.ones((256, 256)), jnp.arange(64) % 7)
    compiled = f.lower(*args).compile()
    jax.block_until_ready(compiled(*args))
    with jax.profiler.trace(str(tmp_path)):
        for _ in range(3):
            jax.block_until_ready(compiled(*args))
    hlo = compiled.as_text()
    times = profile.op_times(str(tmp_path), profile.module_name(hlo))
    by_category, by_scope = profile.breakdown(hlo, times)
    (tmp_path / profile.HLO_FILE).write_text(hlo)  # the trace directory made whole
    assert profile.trace_breakdown(str(tmp_path)) == (by_category, by_scope)
    total = sum(times.values())
    assert total > 0  # every op time lands in exactly one category and one scope
    assert sum(by_category.values()) == pytest.approx(total, rel=1e-9)
    assert sum(by_scope.values()) == pytest.approx(total, rel=1e-9)
    assert by_category["matmul"] > 0 and by_scope["mlp"] > 0
    share = profile.attributed_share(by_scope)
    assert 0 < share < 1 and share == pytest.approx(1 - by_scope["other"] / total)
    ops = profile.classify_ops(hlo)
    assert any(category == "matmul" and scope == "mlp" for category, scope in ops.values())


CLASSIFY_MODULE = """HloModule classify

%fused_norm (p0: f32[8,64]) -> f32[8,64] {
  %p0 = f32[8,64]{1,0} parameter(0)
  %r = f32[8,64]{1,0} rsqrt(%p0), metadata={op_name="jit(step)/micro_batch/jvp(block)/rsqrt"}
  ROOT %m = f32[8,64]{1,0} multiply(%p0, %r), metadata={op_name="jit(step)/jvp(block)/mul"}
}

%fused_wide (p0: f32[8,64]) -> (f32[8,64], f32[8,64], f32[8,64], f32[8,64], f32[8,64], f32[8,64]) {
  %p0 = f32[8,64]{1,0} parameter(0)
  %n = f32[8,64]{1,0} negate(%p0)
  ROOT %six = (f32[8,64]{1,0}, f32[8,64]{1,0}, f32[8,64]{1,0}, f32[8,64]{1,0}, f32[8,64]{1,0}, \
/*index=5*/f32[8,64]{1,0}) tuple(%n, %n, %n, %n, %n, %n)
}

%chunk_body (t: (s32[], f32[8,64])) -> (s32[], f32[8,64]) {
  %t = (s32[], f32[8,64]{1,0}) parameter(0)
  %x = f32[8,64]{1,0} get-tuple-element(%t), index=1
  %head = f32[8,64]{1,0} dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %out = (s32[], f32[8,64]{1,0}) tuple(%i, %head)
}

%chunk_cond (t: (s32[], f32[8,64])) -> pred[] {
  %t = (s32[], f32[8,64]{1,0}) parameter(0)
  ROOT %go = pred[] constant(false)
}

ENTRY %main (x: f32[8,64]) -> (s32[], f32[8,64]) {
  %x = f32[8,64]{1,0} parameter(0)
  %normed = f32[8,64]{1,0} fusion(%x), kind=kLoop, calls=%fused_norm
  %wide = (f32[8,64]{1,0}, f32[8,64]{1,0}, f32[8,64]{1,0}, f32[8,64]{1,0}, f32[8,64]{1,0}, \
/*index=5*/f32[8,64]{1,0}) fusion(%x), kind=kLoop, calls=%fused_wide, \
metadata={op_name="jit(step)/optimizer/neg"}
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,64]{1,0}) tuple(%zero, %normed)
  ROOT %loop = (s32[], f32[8,64]{1,0}) while(%init), condition=%chunk_cond, body=%chunk_body, \
metadata={op_name="jit(step)/micro_batch/jvp(loss)/while"}
}
"""


def test_ops_without_a_name_take_their_fusions_and_loops_scope():
    """XLA's CPU fusions often carry no metadata: an elementwise fusion takes the scope its
    contained ops name, and an op in a loop body without one takes the loop's scope. A
    multi-output fusion is read whatever the length of its result."""
    from bov_jax.bench import profile

    ops = profile.classify_ops(CLASSIFY_MODULE)
    assert ops["normed"] == ("elementwise", "block")
    assert ops["wide"] == ("elementwise", "optimizer")  # a result of six: '/*index=5*/' inside
    assert ops["head"] == ("matmul", "loss")
    assert ops["loop"][1] == "loss"
    seconds = {"normed": 1.0, "head": 3.0, "unknown_op": 1.0}
    by_category, by_scope = profile.breakdown(CLASSIFY_MODULE, seconds)
    assert by_category["elementwise"] == 1.0 and by_category["matmul"] == 3.0
    assert by_scope == {**dict.fromkeys(by_scope, 0.0), "block": 1.0, "loss": 3.0, "other": 1.0}
    assert profile.attributed_share(by_scope) == pytest.approx(0.8)
