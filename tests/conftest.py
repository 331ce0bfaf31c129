"""Test setup: 8 fake CPU devices for sharding tests, fp32 everywhere, XLA's cheap compilation
and one compilation cache for the run; a command's flags."""

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator

import pytest
from absl import flags

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# XLA's cheap compilation (same semantics, slower programs) for the whole run, the commands
# tests start included: most programs here are compiled for a run or two of tiny shapes, and
# compiling is most of the suite's time. (What the tests read of compiled programs, fusions,
# collectives, temporaries, holds under it too: the whole suite passes with it.)
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

# One persistent XLA compilation cache for the whole run, made by the first process to load this
# file (pytest, or pytest-xdist's controller) and inherited through the environment by xdist's
# workers and by the commands tests start as subprocesses: the same program (a tiny model's step,
# say) compiles once per run, not once per process. Its key covers the program, the XLA flags and
# the compile options, so a hit is the executable a fresh compilation would give.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="bov_jax_tests_xla_")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.2"


def pytest_unconfigure(config: pytest.Config) -> None:
    """The run's compilation cache goes with the process that made it."""
    if _OWN_CACHE:
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


@pytest.fixture
def command_flags() -> Iterator[Callable[..., None]]:
    """parse(define_flags, *args): a command's flags defined on absl's FLAGS and parsed from
    `args` (as `python -m` would before its main), all removed again after the test, so that
    commands with flags of the same name can be tested in one process."""
    before, defined = set(flags.FLAGS), set()

    def parse(define_flags: Callable[[], None], *args: str) -> None:
        flags.FLAGS.unparse_flags()
        if define_flags not in defined:
            define_flags()
            defined.add(define_flags)
        flags.FLAGS(["command", *args])

    yield parse
    flags.FLAGS.unparse_flags()
    for name in set(flags.FLAGS) - before:
        delattr(flags.FLAGS, name)
