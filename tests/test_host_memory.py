"""bov_jax/train/host_memory.py: freed host memory is reused instead of faulted in again."""

from __future__ import annotations

import fnmatch
import json
import subprocess
import sys

import pytest

from bov_jax.train import host_memory

# Allocate, touch, free and allocate again a 256 MiB block through the C library; print the
# page faults of touching the second block. Run in a fresh process: malloc's settings are
# process-wide and only act before other threads take arenas.
REALLOCATE = """
import ctypes, ctypes.util, json, resource, sys
from bov_jax.train import host_memory
applied = host_memory.reuse_freed_memory() if sys.argv[1] == "reuse" else False
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = 256 << 20
block = libc.malloc(size)
ctypes.memset(block, 1, size)
libc.free(block)
block = libc.malloc(size)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
ctypes.memset(block, 2, size)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"applied": applied, "faults": faults, "pages": size // 4096}))
"""


def reallocation_faults(mode: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", REALLOCATE, mode],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_freed_block_is_reused_without_page_faults():
    plain = reallocation_faults("plain")
    reused = reallocation_faults("reuse")
    assert reused["applied"] and not plain["applied"]
    # glibc maps a block this large afresh: every page faults again.
    assert plain["faults"] > plain["pages"] // 2, plain
    assert reused["faults"] < reused["pages"] // 20, reused


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({"JAX_PLATFORMS": "cpu"}, True),
        ({"JAX_PLATFORMS": "cuda"}, False),
        ({"JAX_PLATFORMS": "tpu,cpu"}, False),
    ],
)
def test_jax_platforms_decides_where_jax_runs(environ, expected):
    assert host_memory.runs_on_host_cpu(environ) is expected


@pytest.mark.parametrize(
    "device, expected",
    [(None, True), ("/dev/nvidiactl", False), ("/dev/accel0", False), ("/dev/vfio/0", False)],
)
def test_an_accelerator_device_means_not_the_cpu(monkeypatch, device, expected):
    monkeypatch.setattr(host_memory.os.path, "exists", lambda path: path == device)
    devices = [device] if device else []
    monkeypatch.setattr(host_memory.glob, "glob", lambda pattern: fnmatch.filter(devices, pattern))
    assert host_memory.runs_on_host_cpu({}) is expected


def test_opt_out_and_accelerators_leave_malloc_alone(monkeypatch):
    def fail() -> bool:
        raise AssertionError("mallopt must not be called")

    monkeypatch.setattr(host_memory, "reuse_freed_memory", fail)
    assert not host_memory.reuse_freed_memory_on_cpu(
        {"JAX_PLATFORMS": "cpu", "BOV_HOST_MALLOC": "0"}
    )
    assert not host_memory.reuse_freed_memory_on_cpu({"JAX_PLATFORMS": "cuda"})
    monkeypatch.setattr(host_memory, "reuse_freed_memory", lambda: True)
    assert host_memory.reuse_freed_memory_on_cpu({"JAX_PLATFORMS": "cpu"})
