"""Test setup: 8 fake CPU devices for sharding tests, fp32 everywhere; a command's flags."""

import os
from collections.abc import Callable, Iterator

import pytest
from absl import flags

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


@pytest.fixture(scope="module")
def fast_xla() -> Iterator[None]:
    """XLA's cheap compilation (same semantics, slower programs) for a module of many compiled
    programs each run once or twice (`pytestmark = pytest.mark.usefixtures("fast_xla")`),
    restored for the other modules."""
    import jax  # after the environment above

    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", before)


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
