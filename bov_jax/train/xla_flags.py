"""XLA flags for NVIDIA GPUs, added to XLA_FLAGS before JAX starts its backend.

`python -m bov_jax.main` and `python -m bov_jax.bench` call `set_gpu_flags()` first; the
launchers run those. A flag already present in XLA_FLAGS (by name) is left as given, and
BOV_XLA_GPU_FLAGS=0 adds none. Nothing is added without an NVIDIA driver (CPU, TPU) or when
JAX_PLATFORMS excludes CUDA. Whether each flag wins on an H200 is still to be measured
(benchmarks/h200.sh times the bench with and without them; docs/benchmarks.md).
"""

from __future__ import annotations

import os

GPU_FLAGS = (
    # Overlap collectives and independent work by scheduling for latency.
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    # Record fusions, cuBLAS/cuDNN calls and custom calls into CUDA graphs (fewer launches).
    "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN",
    # cuBLAS rather than Triton for plain bf16 GEMMs.
    "--xla_gpu_enable_triton_gemm=false",
)


def on_nvidia_gpu(environ: os._Environ | dict) -> bool:
    platforms = environ.get("JAX_PLATFORMS", "")
    if platforms and "cuda" not in platforms and "gpu" not in platforms:
        return False
    return os.path.exists("/dev/nvidiactl")


def with_gpu_flags(xla_flags: str, flags: tuple[str, ...] = GPU_FLAGS) -> str:
    """`xla_flags` plus every flag of `flags` whose name it does not already set."""
    given = {f.split("=", 1)[0] for f in xla_flags.split()}
    added = [f for f in flags if f.split("=", 1)[0] not in given]
    return " ".join([xla_flags, *added]).strip()


# A profile needs one trace event per op: a command buffer runs its ops as one CUDA graph,
# whose events name none of them (the H200 profile of 2026-12 put 100% of device time under
# "other"), so profiling turns command buffers off.
NO_COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer="


def set_gpu_flags(environ: os._Environ | dict = os.environ, profiling: bool = False) -> None:
    """Add GPU_FLAGS to environ["XLA_FLAGS"] on NVIDIA GPUs unless BOV_XLA_GPU_FLAGS=0; with
    `profiling`, command buffers off (NO_COMMAND_BUFFERS), even if BOV_XLA_GPU_FLAGS=0."""
    if not on_nvidia_gpu(environ):
        return
    flags = GPU_FLAGS if environ.get("BOV_XLA_GPU_FLAGS", "1") != "0" else ()
    if profiling:
        name = NO_COMMAND_BUFFERS.split("=")[0]
        flags = (NO_COMMAND_BUFFERS, *(f for f in flags if f.split("=")[0] != name))
    environ["XLA_FLAGS"] = with_gpu_flags(environ.get("XLA_FLAGS", ""), flags)
