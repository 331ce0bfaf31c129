"""What one decoding step costs on an NVIDIA target, read off the compiled decode loop.

    CUDA_PYTHON=/path/to/venv-with-jax[cuda12]/bin/python
    $CUDA_PYTHON benchmarks/decode_aot.py [--target=h200] [--contexts=2048,32768]

Compiles `bov_jax.inference.decode.decode_loop` ahead of time for one GPU of the target (no GPU
needed; the CUDA plugin's compiler, as `bov_jax.compile`), for d24 in bf16 at batch 8, as
`bash benchmarks/h200.sh decode` runs it: the baseline, BoV with a V cache, BoV without. For
each it prints what the loop body (one decoding step) launches and moves: its ops outside
fusions (each a kernel on a GPU) and their HBM traffic (`bov_jax.compile.hlo.op_traffic`),
the bank kernel's custom calls counted by the table rows they gather rather than the whole
table operand. A decoding step at batch 8 is bound by launches and bytes, not FLOPs, so
equal counts predict equal speed; the H200 run measures it.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import SingleDeviceSharding

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bov_jax import cli  # noqa: E402
from bov_jax.compile import hlo  # noqa: E402
from bov_jax.compile.targets import resolve_target, target_devices  # noqa: E402
from bov_jax.inference import decode  # noqa: E402
from bov_jax.model.gpt import GPT  # noqa: E402
from bov_jax.model.spec import ModelSpec  # noqa: E402
from bov_jax.presets import config_for  # noqa: E402

VARIANTS = {"baseline": ("d24", True), "BoV, V cache": ("d24_bov", False)}
VARIANTS["BoV, no V cache"] = ("d24_bov", True)
BATCH, NEW_TOKENS = 8, 64  # h200.sh decode
MIB = 2**20


def d24_spec(preset: str) -> ModelSpec:
    """The preset at h200.sh's decode sizes (bench_decode's flags there), bf16, its auto
    choices resolved for a GPU (bf16 tables) as they are on the H200."""
    config = config_for(preset)
    config.model.update(
        depth=24,
        model_dim=1536,
        head_dim=128,
        vocab_size=32768,
        param_dtype="bfloat16",
        compute_dtype="bfloat16",
    )
    return ModelSpec.from_config(config.model, "gpu")


def compiled_text(spec: ModelSpec, context: int, eliminate_bank_v: bool, device) -> str:
    """The optimized HLO of the decode loop over a cache of context + NEW_TOKENS slots."""
    on_device = SingleDeviceSharding(device)

    def placed(x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_device)

    def array(shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct:
        return placed(jax.ShapeDtypeStruct(shape, dtype))

    graphdef, state = nnx.split(nnx.eval_shape(lambda: GPT(spec, seed=0)))
    slots = -(-(context + NEW_TOKENS) // decode.SLOT_MULTIPLE) * decode.SLOT_MULTIPLE
    cache = jax.eval_shape(lambda: decode.init_cache(spec, BATCH, slots, None, eliminate_bank_v))
    lowered = decode.decode_loop.lower(
        graphdef,
        jax.tree.map(placed, state),
        jax.tree.map(placed, cache),
        array((BATCH, slots), jnp.int32),
        array((BATCH, spec.vocab_size), jnp.float32),
        array((BATCH,), jnp.int32),
        array((), jnp.int32),
        array((), jnp.float32),  # temperature
        array((), jnp.int32),  # top_k
        array((), jnp.float32),  # top_p
        array((), jnp.int32),  # seed
        array((1,), jnp.int32),
    )
    return lowered.compile().as_text()


def kernel_traffic(instruction: hlo.Instruction, shapes: dict[str, str]) -> float:
    """The bank kernel's bytes: its weights, the window of ids and the table rows it gathers
    (batch x visible slots x table width), its output; not the whole ids and table."""
    weights, _, _, table = (shapes[name] for name in instruction.operands)
    _, (batch, slots, _) = next(hlo.arrays(weights))
    dtype, (_, width) = next(hlo.arrays(table))
    rows = batch * slots * width * hlo.DTYPE_BYTES[dtype]
    ids = batch * slots * hlo.DTYPE_BYTES["s32"]
    return hlo.shape_bytes(weights) + ids + rows + hlo.shape_bytes(instruction.shape)


def step_cost(text: str) -> tuple[int, int, float]:
    """(ops, bank kernels, HBM bytes) of the decode loop's body: one decoding step."""
    module = hlo.parse(text)
    shapes = module.shapes
    loop = next(i for i in module.computations[module.entry] if i.opcode == "while")
    ops = kernels = 0
    traffic = 0.0
    for instruction in filter(hlo.moves_data, module.computations[hlo.called(loop, "body")]):
        ops += 1
        if instruction.opcode == "custom-call" and "xla.gpu.triton" in instruction.attributes:
            kernels += 1
            traffic += kernel_traffic(instruction, shapes)
        else:
            traffic += hlo.op_traffic(module, instruction, shapes)
    return ops, kernels, traffic


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="h200", help="h100, h200 or a100")
    parser.add_argument("--contexts", default="2048,32768", help="comma-separated")
    args = parser.parse_args()
    device = target_devices(resolve_target(args.target, 1))[0]
    print(f"{args.target}: d24 bf16 decode loop, batch {BATCH}; per decoding step (loop body)")
    print(f"{'context':>8} {'variant':>16} {'ops':>5} {'bank kernels':>12} {'HBM MiB':>9}")
    for context in map(int, args.contexts.split(",")):
        for name, (preset, eliminate) in VARIANTS.items():
            text = compiled_text(d24_spec(preset), context, eliminate, device)
            ops, kernels, traffic = step_cost(text)
            print(f"{context:>8} {name:>16} {ops:>5} {kernels:>12} {traffic / MIB:>9.1f}")


if __name__ == "__main__":
    cli.guarded(main)  # a missing CUDA plugin or an unknown target: one line
