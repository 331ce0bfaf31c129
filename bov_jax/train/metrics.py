"""Run outputs: metrics.jsonl, TensorBoard events and the step log line (process 0 only)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import jax

# Dense bf16 peak FLOP/s per chip, by jax device_kind prefix (MFU denominators).
PEAK_FLOPS = {
    "NVIDIA H100": 989e12,
    "NVIDIA H200": 989e12,
    "NVIDIA GH200": 989e12,
    "NVIDIA A100": 312e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
}


def peak_flops_per_device() -> float | None:
    kind = jax.devices()[0].device_kind
    for prefix, flops in PEAK_FLOPS.items():
        if kind.startswith(prefix):
            return flops
    return None


def scalars(record: dict[str, Any], prefix: str = "") -> list[tuple[str, float]]:
    """The numbers of a record as TensorBoard tags; nested dicts give 'outer/inner' tags
    (e.g. coefficients/gamma/8). The step itself is not a scalar."""
    found = []
    for key, value in record.items():
        tag = f"{prefix}{key}"
        if isinstance(value, dict):
            found.extend(scalars(value, tag + "/"))
        elif tag != "step" and isinstance(value, int | float) and not isinstance(value, bool):
            found.append((tag, value))
    return found


class MetricsWriter:
    """Appends one JSON object per logged step to metrics.jsonl and mirrors scalars to
    TensorBoard from `start_step` on; a no-op on processes other than 0."""

    def __init__(self, workdir: Path, start_step: int = 0):
        self.active = jax.process_index() == 0
        if not self.active:
            return
        from tensorboardX import SummaryWriter

        self.jsonl = open(workdir / "metrics.jsonl", "a", buffering=1)
        # purge_step drops events a crashed run wrote past the step this run resumes from
        self.tensorboard = SummaryWriter(str(workdir / "tensorboard"), purge_step=start_step)

    def write(self, record: dict[str, Any]) -> None:
        if not self.active:
            return
        self.jsonl.write(json.dumps(record) + "\n")
        for key, value in scalars(record):
            self.tensorboard.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self.active:
            self.jsonl.close()
            self.tensorboard.close()


class Throughput:
    """Tokens/s, MFU and ETA over the steps since the first timed one (compile excluded)."""

    def __init__(self, tokens_per_step: int, flops_per_token: int, warmup_steps: int = 1):
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.warmup = warmup_steps
        self.peak = peak_flops_per_device()
        self.timed_steps = 0
        self.timed_seconds = 0.0
        self.last = time.perf_counter()

    def tick(self) -> float:
        """Mark the end of a step; returns its duration in seconds."""
        now = time.perf_counter()
        dt, self.last = now - self.last, now
        if self.warmup > 0:
            self.warmup -= 1
        else:
            self.timed_steps += 1
            self.timed_seconds += dt
        return dt

    def restart(self) -> None:
        """Exclude the time since the last tick (evaluation, sampling, saving)."""
        self.last = time.perf_counter()

    def tokens_per_sec(self, dt: float) -> float:
        seconds = self.timed_seconds / self.timed_steps if self.timed_steps else dt
        return self.tokens_per_step / seconds

    def mfu(self, tokens_per_sec: float) -> float | None:
        if self.peak is None:
            return None
        return tokens_per_sec * self.flops_per_token / (self.peak * jax.device_count())

    def eta_seconds(self, steps_left: int, dt: float) -> float:
        seconds = self.timed_seconds / self.timed_steps if self.timed_steps else dt
        return steps_left * seconds


def log_line(
    step: int,
    num_steps: int,
    loss: float,
    lr: float,
    dt: float,
    tok_s: float,
    mfu: float | None,
    eta: float,
) -> str:
    parts = [
        f"step {step:05d}/{num_steps:05d} ({100 * step / num_steps:.2f}%)",
        f"loss: {loss:.6f}",
        f"lr: {lr:.3e}",
        f"dt: {1000 * dt:.1f}ms",
        f"tok/sec: {tok_s:,.0f}",
    ]
    if mfu is not None:
        parts.append(f"mfu: {100 * mfu:.2f}")
    parts.append(f"eta: {eta / 60:.1f}m")
    return " | ".join(parts)
