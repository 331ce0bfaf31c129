"""TPU splash attention (Pallas) for the causal and sliding-window layers.

jax's own kernel (`jax.experimental.pallas.ops.tpu.splash_attention`) skips the blocks a
mask leaves empty, so a window-W layer costs O(T * W) instead of XLA's O(T^2). It is compiled
natively when the ambient mesh's devices are TPUs (also a compile-only TPU target on a CPU
host, bov_jax.compile), else, or without a mesh, for this host's backend; off TPU it runs in
Pallas interpret mode (slow; for tests only).

The train and eval steps trace under their mesh as an abstract mesh (bov_jax.train.step.
on_mesh): `jax.set_mesh` would also send eager work during tracing, where the kernel builds
its mask tables, to the mesh's devices, and a compile-only target's devices run nothing.

The kernel wants a sequence length that is a multiple of its blocks (multiples of 128):
inputs are padded at the end and the padding sliced off. The padding is exact: under a
causal mask no real query sees a later (padded) key.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

from bov_jax import sharding

LANES = 128  # every splash block size must be a multiple of this
BLOCKS = (512, 256, 128)  # preferred block sizes, largest first


def block_size(seq: int) -> int:
    """The largest preferred block that divides seq (a multiple of LANES)."""
    return next(b for b in BLOCKS if seq % b == 0)


def layer_mask(seq: int, window: int) -> masks.Mask:
    """Query i sees keys j with 0 <= i - j <= window: causal when the window spans the
    sequence, else a left-only local window. (seq, seq)."""
    if window >= seq - 1:
        return masks.CausalMask((seq, seq))
    return masks.LocalMask((seq, seq), window_size=(window, 0), offset=0)


@functools.lru_cache(maxsize=64)
def make_kernel(
    seq: int, heads: int, window: int, block: int, interpret: bool, mesh: Any = None
) -> kernel.SplashAttentionKernel:
    """A multi-head splash kernel (forward and backward) for one layer shape, cached per
    ambient mesh (`mesh`: its mask tables carry the mesh they were made under, and a kernel
    made under one mesh refuses to run under another).

    Its mask tables are built as concrete arrays even when first asked for inside a jit
    trace, so the cached kernel never holds a tracer.
    """
    mask = masks.MultiHeadMask([layer_mask(seq, window)] * heads)
    blocks = kernel.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    with jax.ensure_compile_time_eval():
        return kernel.make_splash_mha(
            mask, block_sizes=blocks, head_shards=1, q_seq_shards=1, interpret=interpret
        )


def kernel_platform() -> str:
    """The platform the kernel is traced for: the ambient mesh's devices', else this host's."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else mesh.abstract_device
    return jax.default_backend() if device is None else device.platform


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, window: int, block: int | None) -> jax.Array:
    """Splash attention on one device's shard. q, k, v: (B, T, H, hd) -> (B, T, H, hd)."""
    _, seq, heads, head_dim = q.shape
    padded = -(-seq // LANES) * LANES
    block = block or block_size(padded)
    if padded % block:
        raise ValueError(f"splash block {block} does not divide the padded length {padded}")
    interpret = kernel_platform() != "tpu"
    mesh = jax.sharding.get_abstract_mesh()
    splash = make_kernel(padded, heads, window, block, interpret, None if mesh.empty else mesh)

    def heads_major(x: jax.Array) -> jax.Array:  # (B, T, H, hd) -> (B, H, T_pad, hd)
        return jnp.pad(x, ((0, 0), (0, padded - seq), (0, 0), (0, 0))).transpose(0, 2, 1, 3)

    q = q * jnp.asarray(1.0 / math.sqrt(head_dim), q.dtype)  # the kernel does not scale
    y = jax.vmap(splash)(heads_major(q), heads_major(k), heads_major(v))
    return y.transpose(0, 2, 1, 3)[:, :seq]


def attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, window: int, block: int | None = None
) -> jax.Array:
    """Causal splash attention where query i sees keys j with 0 <= i - j <= window.

    q, k, v: (B, T, H, hd) -> (B, T, H, hd); softmax scale 1/sqrt(hd); block: the kernel's
    block size (default: the largest of BLOCKS dividing T rounded up to 128). Pallas
    kernels are not partitioned by XLA: under an ambient mesh (module doc) each device runs
    the kernel on its batch rows and heads (`sharding.per_device_heads`).
    """
    attend = functools.partial(_attend, window=window, block=block)
    return sharding.per_device_heads(attend)(q, k, v)
