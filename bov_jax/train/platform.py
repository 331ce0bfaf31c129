"""Does jax run on the platform a job asked for (cpu, gpu or tpu)?

`python -m bov_jax.main --check_platform=gpu` prints the backend and its local devices and
exits 0 when jax's default backend is that platform; otherwise one `error: ...` line with the
fix, exit 2. Job scripts run it before they start the training processes
(launch/slurm.sbatch), so that a GPU job whose environment holds the CPU build of jax stops at
once instead of training on the host's CPUs.

No TPU probe where there is no TPU. With libtpu installed (requirements-aot.txt, for
`bov_jax.compile`'s TPU targets) and JAX_PLATFORMS unset, jax starts every backend it knows,
TPU included, and libtpu prints half a dozen lines on a host without TPU chips ("Failed to find
host bounds", "Logging before InitGoogle()", ...) before jax falls back to the CPU.
`skip_absent_tpu` runs when `bov_jax` is imported, before any backend starts: on a host with no
TPU chip on its PCI bus it sets this process's `jax_platforms` to the backends that can start
here (the CPU, and CUDA where an NVIDIA GPU and jax's CUDA plugin are both present), so libtpu
is never loaded. It changes nothing where JAX_PLATFORMS is set (the user's choice), where a TPU
is present, or where libtpu is not installed. Only this process's config is set, not the
environment, so the jobs a command launches on other hosts choose for themselves. Compiling for
a TPU target loads libtpu on its own (`jax.experimental.topologies`), so `bov_jax.compile` is
unaffected.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import sys

from bov_jax.errors import UserError

PLATFORMS = ("cpu", "gpu", "tpu")
INSTALL = {
    "cpu": "pip install -r requirements.txt",
    "gpu": 'pip install -U "jax[cuda12]"',
    "tpu": 'pip install -U "jax[tpu]"',
}


def backend_summary() -> tuple[str, str]:
    """(jax's default backend, e.g. 'gpu', or why none started; a line naming its devices)."""
    import jax

    logging.getLogger("jax").setLevel(logging.ERROR)  # no "falling back to cpu" warning
    try:
        devices = jax.local_devices()
    # JAX_PLATFORMS names a platform that cannot start here (jax 0.10 may assert instead)
    except (RuntimeError, AssertionError) as err:
        reason = str(err).splitlines()[0] if str(err) else "jax could not start a backend"
        return f"no backend ({reason})", ""
    kinds = sorted({d.device_kind for d in devices})
    return jax.default_backend(), f"{len(devices)} local devices ({', '.join(kinds)})"


def check_platform(wanted: str) -> str:
    """The line to print when jax runs on `wanted`; UserError (with the fix) when it does not."""
    if wanted not in PLATFORMS:
        raise UserError(f"platform {wanted!r}: expected one of {', '.join(PLATFORMS)}")
    import jax

    backend, devices = backend_summary()
    where = f"jax {jax.__version__} under {sys.executable}"
    if backend != wanted:
        raise UserError(
            f"the job asked for {wanted} but {where} runs on {backend}: install jax for "
            f"{wanted} in that environment ({INSTALL[wanted]}) or point PYTHON (or VENV) at "
            "one that has it"
        )
    return f"{where}: {backend}, {devices}"


def cuda_plugin_installed() -> bool:
    """Whether jax's CUDA plugin (jax[cuda12] / jax[cuda13]) is installed."""
    plugins = importlib.metadata.entry_points(group="jax_plugins")
    return any("cuda" in plugin.name for plugin in plugins)


def platforms_without_tpu(environ: os._Environ | dict = os.environ) -> str | None:
    """The value for `jax_platforms` that leaves the TPU backend out, or None to keep jax's
    own choice (JAX_PLATFORMS set, a TPU chip present, libtpu absent, or an NVIDIA GPU
    without the CUDA plugin, where jax's own warning says what to install)."""
    if environ.get("JAX_PLATFORMS") or importlib.util.find_spec("libtpu") is None:
        return None
    from jax._src import hardware_utils  # jax's own probe of the PCI bus (no backend starts)

    if hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0:
        return None
    if hardware_utils.has_visible_nvidia_gpu():
        return "cuda,cpu" if cuda_plugin_installed() else None
    return "cpu"


def skip_absent_tpu() -> None:
    """Set this process's `jax_platforms` to `platforms_without_tpu()` when it is not None."""
    platforms = platforms_without_tpu()
    if platforms is not None:
        import jax

        jax.config.update("jax_platforms", platforms)
