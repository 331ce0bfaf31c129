"""Keep freed host memory mapped for reuse when JAX computes on the host's CPU.

XLA's CPU runtime allocates every step's temporaries afresh: about 1.1 GB a step for config a
of docs/benchmarks.md (the loss's (rows, chunk, vocab) fp32 blocks, the tables' gradients
and moments). glibc serves blocks that large with mmap, or from a thread's own arena, and
hands them back to the kernel when they are freed, so the next step touches new pages: about
270,000 page faults a step for config a. On the 2-core VMs of docs/benchmarks.md those
faults cost 0.75-8.8 s of system time a step, depending on the host's load.

`reuse_freed_memory()` sets glibc's malloc (mallopt) to one arena, no mmap'd blocks and no
trimming below 2 GiB of free memory at the top of the heap, so that a freed step's pages
serve the next step's temporaries without a fault. It only works before JAX starts its
backend: threads that already took an arena of their own keep it. The cost is that the
process keeps its peak memory until it exits. `bov_jax.main` and `bov_jax.bench` call it
first when JAX will run on the CPU (`runs_on_host_cpu`); BOV_HOST_MALLOC=0 leaves malloc as
it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os

from bov_jax.train import xla_flags

# mallopt parameters of glibc's malloc.h.
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
SETTINGS = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1))


def runs_on_host_cpu(environ: os._Environ | dict) -> bool:
    """Whether JAX will compute on the CPU: JAX_PLATFORMS is "cpu", or it is unset and the
    machine has no NVIDIA driver (/dev/nvidiactl) and no TPU (/dev/accel*, /dev/vfio/N)."""
    platforms = environ.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    tpus = glob.glob("/dev/accel*") + glob.glob("/dev/vfio/[0-9]*")
    return not (xla_flags.on_nvidia_gpu(environ) or tpus)


def reuse_freed_memory() -> bool:
    """Apply SETTINGS to glibc's malloc; False where the C library has no mallopt (not
    glibc) or refuses a setting."""
    path = ctypes.util.find_library("c")
    libc = ctypes.CDLL(path) if path else None
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return all(libc.mallopt(param, value) == 1 for param, value in SETTINGS)


def reuse_freed_memory_on_cpu(environ: os._Environ | dict = os.environ) -> bool:
    """`reuse_freed_memory()` when JAX will run on the CPU, unless BOV_HOST_MALLOC=0; True
    when applied. Call it before anything starts JAX's backend."""
    if environ.get("BOV_HOST_MALLOC", "1") == "0" or not runs_on_host_cpu(environ):
        return False
    return reuse_freed_memory()
