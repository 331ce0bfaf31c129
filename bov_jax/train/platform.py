"""Does jax run on the platform a job asked for (cpu, gpu or tpu)?

`python -m bov_jax.main --check_platform=gpu` prints the backend and its local devices and
exits 0 when jax's default backend is that platform; otherwise one `error: ...` line with the
fix, exit 2. Job scripts run it before they start the training processes
(launch/slurm.sbatch), so that a GPU job whose environment holds the CPU build of jax stops at
once instead of training on the host's CPUs.
"""

from __future__ import annotations

import logging
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
