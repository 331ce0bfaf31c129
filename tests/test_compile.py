"""Ahead-of-time compilation for TPU targets on this CPU host (libtpu, requirements-aot.txt).

One tiny BoV model (2 layers, T = 128, `auto` attention and dtypes) on an fsdp x tensor mesh
of a v5e-4 is compiled once for its train step and its sampling engine's prefill and decode
loop; the tests read that report. The detectors it relies on (an interpreted kernel, an fp32
whole-batch logits buffer) are each shown to fire on a program that has the thing.
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from helpers import tiny_config
from test_cli import run_forked  # `python -m` of commands, forked from one interpreter

from bov_jax import sharding
from bov_jax.accounting import param_counts, training_plan
from bov_jax.cli import UserError
from bov_jax.compile import aot, hlo, targets
from bov_jax.compile.report import Options, run
from bov_jax.model import splash
from bov_jax.model.spec import ModelSpec

LAYERS, SEQ, ROWS = 2, 128, 2  # rows per device per micro-batch


def tiny_tpu_config(seq_len: int = SEQ):
    """Width 64 (two heads of 32), vocab 320 (160 per tensor shard), a loss chunk of 32
    positions, 2 micro-batches of 2 rows per device on data 1 x fsdp 2 x tensor 2."""
    config = tiny_config(
        "d12_bov",
        depth=LAYERS,
        seq_len=seq_len,
        vocab_size=320,
        short_window=32,
        attention_impl="auto",
        compute_dtype="auto",
        loss_chunk_tokens=seq_len,
    )
    config.mesh.update(data=1, fsdp=2, tensor=2)
    t = config.train
    t.num_steps, t.device_batch_size = 10, ROWS
    t.total_batch_tokens = 2 * ROWS * 2 * seq_len  # 2 micro-batches over the 2 fsdp devices
    return config


@pytest.fixture(scope="module")
def report():
    config = tiny_tpu_config()
    return run(config, Options(target="v5e-4", steps=("train", "prefill", "decode")), log=None)


def test_auto_choices_follow_the_target_not_the_host(report):
    assert jax.default_backend() == "cpu"
    assert (report["attention_impl"], report["compute_dtype"]) == ("splash", "bfloat16")
    assert report["device_kind"] == "TPU v5 lite" and report["chips"] == 4
    assert report["mesh"] == {"data": 1, "fsdp": 2, "tensor": 2}
    # The report names the compiler options it ran under (conftest's 8 host devices).
    assert "--xla_force_host_platform_device_count=8" in report["compiler_flags"]["XLA_FLAGS"]


def test_train_step_holds_native_splash_kernels_and_fits(report):
    train = report["steps"]["train"]
    # Per layer: the forward kernel and the backward's dq and dkv kernels; the micro-batch
    # loop's body is one copy of the program.
    assert train["kernels"]["splash"] == 3 * LAYERS == report["attention_kernels"]
    assert train["interpreted_kernel_ops"] == 0
    assert train["fp32_logits_buffers"] == []
    assert report["micro_batches"] == 2 and 2 in train["loop_trip_counts"]
    assert report["fits"] and 0 < report["peak_memory_gib"] < report["hbm_gib"] == 16
    memory = train["memory_gib"]
    assert memory["alias"] > 0  # the donated state is updated in place
    assert memory["peak"] == pytest.approx(
        memory["argument"] + memory["output"] - memory["alias"] + memory["temporary"], abs=1e-3
    )


def test_train_step_collectives_and_flops(report):
    train = report["steps"]["train"]
    # fsdp gathers each device's tensor shard of every bf16 block matrix (at least once) and
    # reduces the gradients.
    counts = param_counts(ModelSpec.from_config(tiny_tpu_config().model))
    shard_bytes = 2 * (counts.flop_matmul - counts.lm_head) / 2
    assert train["collectives"]["all-gather"]["bytes"] >= shard_bytes
    assert {"all-reduce", "reduce-scatter"} & set(train["collectives"])
    assert report["collectives"] == train["collectives"]
    # ... and moves little else: the activations stay on their batch shards and the lm_head
    # gradient is reduced once per micro-batch, not once per loss chunk. Before the
    # activations were pinned, this step gathered 12x, reduced 5.4x and exchanged (all-to-all)
    # 4.6x its fp32 parameter bytes; pinned, 5.8x, 2.6x and 0.3x; with the optimizer state
    # sharded like the parameters, 4.7x, 2.6x and 0.3x.
    fp32_params = 4 * counts.total
    moved = {kind: c["bytes"] / fp32_params for kind, c in train["collectives"].items()}
    assert moved["all-gather"] < 8 and moved["all-reduce"] < 4
    assert moved.get("all-to-all", 0) < 1
    flops = train["flops"]
    # The model's dots (attention is inside the kernels) against 6 x matmul parameters x
    # tokens; Muon's orthogonalisation is the rest.
    assert flops["xla_model_over_comparable"] == pytest.approx(1.0, abs=0.02)
    assert flops["xla_optimizer_per_step"] > 0
    assert flops["analytic_per_step"] > flops["analytic_matmul_per_step"]


def test_one_micro_batch_costs_half_of_two(report):
    """The same rows per device in one micro-batch and in two (the module's report): per
    token, the same kernels and dot FLOPs (a 1-trip scan made XLA TPU run part of the forward
    twice: at depth 4 of d12 BoV, 20 splash kernels for 12 and 1.56x the model's dot FLOPs)."""
    config = tiny_tpu_config()
    config.train.total_batch_tokens = 2 * ROWS * SEQ  # 1 micro-batch over the 2 fsdp devices
    one = run(config, Options(target="v5e-4", steps=("train",)), log=None)
    assert (one["micro_batches"], report["micro_batches"]) == (1, 2)
    assert one["device_batch_size"] == report["device_batch_size"] == ROWS
    one, two = one["steps"]["train"], report["steps"]["train"]
    assert one["kernels"]["splash"] == two["kernels"]["splash"] == 3 * LAYERS
    model = [r["flops"]["xla_model_per_step"] for r in (one, two)]
    assert 2 * model[0] == pytest.approx(model[1], rel=1e-3)


@pytest.fixture
def compile_once(monkeypatch):
    """Each program compiled once per test: every run of the report for one topology gets the
    same devices (its description), and a program lowered again for them (the same StableHLO
    text; the source locations, which name the call site, aside) reuses the executable of its
    first compilation, as the compiler would make the same one again. For tests that compile
    a target's steps more than once, where what they check is not the compilation itself."""
    from bov_jax.compile import report as report_module

    describe, devices = report_module.target_devices, {}

    def same_devices(target):
        key = (target.platform, target.topology, target.options)
        if key not in devices:
            devices[key] = describe(target)
        return devices[key]

    compile, compiled = jax.stages.Lowered.compile, {}

    def once(self, *args, **kwargs):
        if args or kwargs:
            return compile(self, *args, **kwargs)
        text = self.as_text()
        if text not in compiled:
            compiled[text] = compile(self)
        return compiled[text]

    monkeypatch.setattr(report_module, "target_devices", same_devices)
    monkeypatch.setattr(jax.stages.Lowered, "compile", once)
    return compiled


def test_find_rows_prefers_fewer_rows_to_recomputation(monkeypatch, compile_once):
    """On a chip whose memory holds the plain step at 1 row per micro-batch but not at 2,
    --find_rows with train.remat=auto picks 1 row without recomputation (the same FLOPs in
    more micro-batches) over 2 rows recomputed, and says what that saves: the recomputed
    step at 2 rows does more model FLOPs. Rows of 512 positions, for activations that the
    report's peaks (to 1e-4 GiB) tell apart."""
    from bov_jax.compile import report as report_module
    from bov_jax.compile.__main__ import held_back_line

    peaks = {}
    for rows in (1, 2):
        config = tiny_tpu_config(seq_len=512)
        config.train.remat = "none"
        options = Options(target="v5e-4", steps=("train",), device_batch_size=rows)
        peaks[rows] = run(config, options, log=None)["peak_memory_gib"]
    assert peaks[1] < peaks[2]
    real = targets.resolve_target("v5e-4")
    between = int((peaks[1] + peaks[2]) / 2 / 0.9 * 2**30)  # fits 90%: 1 row, not 2
    monkeypatch.setattr(
        report_module, "resolve_target", lambda *a: dataclasses.replace(real, hbm_bytes=between)
    )
    config = tiny_tpu_config(seq_len=512)
    config.train.remat = "auto"
    found = run(config, Options(target="v5e-4", steps=("train",), find_rows=True), log=None)
    assert found["find_rows"]["largest_fitting"] == found["device_batch_size"] == 1
    step = found["steps"]["train"]
    assert step["fits"] and not step["schedule"]["remat"]
    alternative = step["recomputed_alternative"]
    assert alternative["device_batch_size"] == 2 and alternative["remat"]
    assert alternative["flops_saved"] > 0.05  # each block's forward done twice at 2 rows
    # What held the plain step at 2 rows back, by buffer, summing to its peak.
    held = alternative["without_remat"]
    buffers = held["buffers_bytes"]
    assert list(buffers) == [
        "sharded state",
        "compute copy",
        "gradient accumulator",
        "micro-batch gradients",
        "activations and workspace",
    ]
    assert held["peak_gib"] == peaks[2]
    assert sum(buffers.values()) / 2**30 == pytest.approx(held["peak_gib"], rel=1e-9)
    assert min(buffers.values()) > 0
    # fp32 sums of the bf16-gathered matrices, bf16 sums of the tables gathered as stored
    assert buffers["compute copy"] < buffers["gradient accumulator"] < 2 * buffers["compute copy"]
    assert held["peak_gib"] - held["recomputation_frees_gib"] == pytest.approx(
        alternative["peak_gib"], abs=1e-3
    )
    assert held["recomputation_flops_over_plain"] > 1.05
    assert held_back_line(held).startswith("  without recomputation: peak ")


def test_decode_engine_compiles_for_the_target(report):
    for name in ("prefill", "decode"):
        step = report["steps"][name]
        assert step["fits"] and step["fp32_logits_buffers"] == []
        assert step["attention_kernels"] == 0  # cached attention is XLA's
    assert report["steps"]["decode"]["loop_trip_counts"]  # the token loop


def test_interpreted_kernels_are_detected():
    """The same kernel compiled for this host's CPUs runs interpreted: its math is XLA dots."""
    mesh = sharding.make_mesh(tiny_tpu_config().mesh, jax.devices()[:4])
    spec = jax.sharding.PartitionSpec(sharding.BATCH_AXES, None, "tensor")
    q = jax.ShapeDtypeStruct((2, SEQ, 2, 32), jnp.float32, sharding=mesh_sharding(mesh, spec))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        lowered = jax.jit(lambda q: splash.attention(q, q, q, window=8)).lower(q)
    module = hlo.parse(lowered.compile().as_text())
    assert hlo.interpreted_kernel_ops(module) > 0
    assert hlo.attention_kernels(module)["mosaic"] == 0


def mesh_sharding(mesh, spec):
    return jax.sharding.NamedSharding(mesh, spec)


def test_fp32_logits_buffers_are_detected():
    """Whole-batch fp32 logits (rows x T x V) compiled for the TPU target are reported."""
    devices = targets.target_devices(targets.resolve_target("v5e-4"))
    mesh = sharding.make_mesh(tiny_tpu_config().mesh, devices)
    h = jax.ShapeDtypeStruct((4, SEQ, 64), jnp.bfloat16, sharding=sharding.batch_sharding(mesh))
    w = jax.ShapeDtypeStruct((64, 320), jnp.bfloat16, sharding=sharding.replicated(mesh))
    logits = jax.jit(
        lambda h, w: jnp.einsum("btd,dv->btv", h, w, preferred_element_type=jnp.float32)
    )
    module = hlo.parse(logits.lower(h, w).compile().as_text())
    assert hlo.large_fp32(module, {320}, 2 * SEQ) == [f"f32[2,{SEQ},320]"]
    assert hlo.large_fp32(module, {320}, 4 * SEQ) == []


def test_a_step_the_compiler_refuses_is_reported_as_not_fitting():
    """The TPU compiler stops at a program that cannot fit; the report keeps its figure."""
    devices = targets.target_devices(targets.resolve_target("v5e-4"))
    mesh = sharding.make_mesh(tiny_tpu_config().mesh, devices)
    x = jax.ShapeDtypeStruct((2**17,), jnp.float32, sharding=sharding.replicated(mesh))
    square = jax.jit(lambda x: (lambda y: y @ y[:, :128])(jnp.outer(x, x)))  # y: 64 GiB
    with pytest.raises(jax.errors.JaxRuntimeError) as refused:
        square.lower(x).compile()
    report = aot.out_of_memory(refused.value, 1.0, 1.0)
    assert report["fits"] is False and report["memory_gib"]["temporaries"] > 16  # a v5e has 16
    assert report["peak_is_lower_bound"] and report["memory_gib"]["peak"] > 16
    assert report["compiler_refused"].startswith("RESOURCE_EXHAUSTED")


def test_multi_host_slice_mesh_spans_every_chip():
    """v5p-64: 32 chips on 8 hosts; the mesh and the batch layout cover all of them."""
    config = tiny_tpu_config()
    config.mesh.update(data=-1, fsdp=4, tensor=1)
    config.train.total_batch_tokens = 32 * ROWS * SEQ
    target = targets.resolve_target("v5p-64")
    devices = targets.target_devices(target)
    setup = aot.Setup.build(config, target, devices, training_plan(config))
    assert target.topology == "v5p:2x4x4" and len(devices) == 32
    assert setup.mesh.size == 32 and set(setup.mesh.devices.flat) == set(devices)
    assert setup.processes == 8 and dict(setup.mesh.shape) == {"data": 8, "fsdp": 4, "tensor": 1}
    layout = setup.layout()
    assert (layout.micro_rows, layout.rows_per_process) == (32 * ROWS, 4 * ROWS)
    params = jax.tree.leaves(setup.state.params)
    assert all(p.sharding.mesh.devices.size == 32 for p in params)


def test_fsdp_over_a_3d_torus_reduce_scatters_in_stages(monkeypatch, compile_once):
    """v5p-16 (2x2x2): libtpu turns one reduce-scatter over all 8 chips into an all-reduce of
    the whole gradient; the step's two stages (over 2 chips, then the other 4) compile to
    reduce-scatters and move fewer bytes on the wire (at this tiny width libtpu still
    all-reduces a few small tables: at d32's the stages halve the bytes, docs/targets.md)."""
    from bov_jax.train import torus

    def train_step_collectives() -> dict:
        config = tiny_tpu_config(seq_len=64)  # the gradients' sizes do not depend on it
        config.mesh.update(data=1, fsdp=8, tensor=1)
        config.train.total_batch_tokens = 2 * ROWS * 8 * 64
        return run(config, Options(target="v5p-16", steps=("train",)), log=None)["collectives"]

    staged = train_step_collectives()
    monkeypatch.setattr(torus, "scatter_stages", lambda mesh, axis: ())
    flat = train_step_collectives()
    assert "reduce-scatter" not in flat and staged["reduce-scatter"]["count"] >= 2 * LAYERS
    reducing = [
        sum(c[kind]["wire_bytes"] for kind in ("all-reduce", "reduce-scatter") if kind in c)
        for c in (staged, flat)
    ]
    assert reducing[0] < 0.9 * reducing[1], reducing  # at this size some stay all-reduces


@pytest.mark.parametrize(
    ("name", "topology", "chips", "hbm_gib"),
    [
        ("v4-8", "v4:2x2x1", 4, 32),
        ("v5e-4", "v5e:2x2", 4, 16),
        ("v5e-8", "v5e:2x4", 8, 16),
        ("v5p-8", "v5p:2x2x1", 4, 95),
        ("v6e-8", "v6e:2x4", 8, 32),
        ("v5p-128", "v5p:4x4x4", 64, 95),
        ("v6e-256", "v6e:16x16", 256, 32),
    ],
)
def test_tpu_names(name, topology, chips, hbm_gib):
    target = targets.resolve_target(name)
    assert (target.topology, target.chips, target.hbm_bytes) == (topology, chips, hbm_gib * 2**30)


def test_gpu_targets_read_their_config_files():
    h200 = targets.resolve_target("h200", 16)
    assert (h200.platform, h200.topology, h200.chips) == ("gpu", "1x2x8", 16)
    assert h200.hbm_bytes == 151397597184
    assert targets.resolve_target("h100", 4).topology == "1x1x4"


@pytest.mark.parametrize(
    ("name", "gpus", "message"),
    [
        ("v9-8", 8, "unknown --target=v9-8"),
        ("v5p-6", 8, "v5p-N with N a power of two from 8"),
        ("v5p-7", 8, "2 per chip"),
        ("v5e-2", 8, "(not 2) to 256"),
        ("h200", 12, "--gpus=12"),
    ],
)
def test_bad_targets_are_named(name, gpus, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        targets.resolve_target(name, gpus)


def test_command_line_help_and_bad_target():
    command = "bov_jax.compile"
    helped, bad = run_forked(
        [(command, ["--help"]), (command, ["--config=configs/quickstart.py", "--target=v5q-8"])]
    )
    assert helped.returncode == 0, helped.stderr[-2000:]
    assert bad.returncode == 2
    errors = [line for line in bad.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: unknown --target=v5q-8; expected {targets.known_targets()}"]


ON_CHIP_MODULE = """HloModule traffic

%add_fusion (p0: f32[768,4096], p1: f32[768,4096]) -> f32[768,4096] {
  %p0 = f32[768,4096]{1,0} parameter(0)
  %p1 = f32[768,4096]{1,0} parameter(1)
  ROOT %sum = f32[768,4096]{1,0} add(%p0, %p1)
}

ENTRY %main (w: bf16[768,768], g: f32[768,4096]) -> f32[768,4096] {
  %w = bf16[768,768]{1,0:T(8,128)} parameter(0)
  %g = f32[768,4096]{1,0:T(8,128)} parameter(1)
  %pre = (bf16[768,768]{1,0:T(8,128)}, bf16[768,768]{1,0:T(8,128)S(1)}, u32[]{:S(2)}) copy-start(%w)
  %in_vmem = f32[768,4096]{1,0:T(8,128)S(1)} fusion(%g, %g), kind=kLoop, calls=%add_fusion
  ROOT %in_hbm = f32[768,4096]{1,0:T(8,128)} fusion(%in_vmem, %g), kind=kLoop, calls=%add_fusion
}
"""


def test_hbm_traffic_leaves_out_what_the_compiler_placed_on_chip():
    """TPU layouts name a memory space: `S(1)` (VMEM) is on chip, not HBM traffic; a prefetch
    into it reads its source from HBM once."""
    module = hlo.parse(ON_CHIP_MODULE)
    ops = {i.name: i for i in module.computations["main"]}
    grad, weight = 4 * 768 * 4096, 2 * 768 * 768
    assert hlo.op_traffic(module, ops["pre"], module.shapes) == weight
    assert hlo.op_traffic(module, ops["in_vmem"], module.shapes) == 2 * grad  # reads g twice
    assert hlo.op_traffic(module, ops["in_hbm"], module.shapes) == 2 * grad  # g in, result out
    assert hlo.memory_traffic(module) == weight + 4 * grad
    # The same program with everything in HBM: each array counts.
    everywhere = hlo.parse(ON_CHIP_MODULE.replace("S(1)", ""))
    assert hlo.memory_traffic(everywhere) == 2 * weight + 6 * grad


FUSED_GATHER_MODULE = """HloModule fused_gather

%gather_sum (table: f32[1000,64], ids: s32[32,1]) -> f32[64] {
  %table = f32[1000,64]{1,0} parameter(0)
  %ids = s32[32,1]{1,0} parameter(1)
  %rows = f32[32,64]{1,0} gather(%table, %ids), slice_sizes={1,64}
  %zero = f32[] constant(0)
  ROOT %sum = f32[64]{0} reduce(%rows, %zero), dimensions={0}, to_apply=%add
}

%gather_and_read (table: f32[1000,64], ids: s32[32,1]) -> (f32[32,64], f32[1000,64]) {
  %table = f32[1000,64]{1,0} parameter(0)
  %ids = s32[32,1]{1,0} parameter(1)
  %rows = f32[32,64]{1,0} gather(%table, %ids), slice_sizes={1,64}
  %twice = f32[1000,64]{1,0} add(%table, %table)
  ROOT %both = (f32[32,64]{1,0}, f32[1000,64]{1,0}) tuple(%rows, %twice)
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %c = f32[] add(%a, %b)
}

ENTRY %main (table: f32[1000,64], ids: s32[32,1]) -> f32[64] {
  %table = f32[1000,64]{1,0} parameter(0)
  %ids = s32[32,1]{1,0} parameter(1)
  %whole = (f32[32,64]{1,0}, f32[1000,64]{1,0}) fusion(%table, %ids), calls=%gather_and_read
  ROOT %weighed = f32[64]{0} fusion(%table, %ids), calls=%gather_sum
}
"""


def test_hbm_traffic_of_a_fusion_counts_the_rows_it_gathers_not_the_table():
    """A table read only through a gather inside a fusion (a bank or an embedding lookup)
    moves the rows gathered; read whole by another op of the fusion, it moves whole."""
    module = hlo.parse(FUSED_GATHER_MODULE)
    ops = {i.name: i for i in module.computations["main"]}
    table, rows, ids, out = 4 * 1000 * 64, 4 * 32 * 64, 4 * 32, 4 * 64
    assert hlo.fused_reads(module, ops["weighed"]) == {0: rows}
    assert hlo.op_traffic(module, ops["weighed"], module.shapes) == rows + ids + out
    assert hlo.fused_reads(module, ops["whole"]) == {}
    assert hlo.op_traffic(module, ops["whole"], module.shapes) == table + ids + rows + table
