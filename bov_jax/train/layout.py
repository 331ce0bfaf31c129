"""How a step's batch is split over micro-batches, devices and processes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax

from bov_jax import sharding
from bov_jax.accounting import TrainingPlan


def largest_divisor(rows_per_device: int, at_most: int) -> int:
    """The largest size <= `at_most` that splits `rows_per_device` into whole micro-batches."""
    return max(d for d in range(1, min(at_most, rows_per_device) + 1) if rows_per_device % d == 0)


def divisibility_fix(tokens: int, seq_len: int, batch_devices: int, device_batch: int) -> str:
    """The override that makes a step of `tokens` split into micro-batches: the largest
    train.device_batch_size below `device_batch` that divides each device's rows, or a
    train.total_batch_tokens that gives every device whole rows."""
    rows, remainder = divmod(tokens, seq_len * batch_devices)  # rows per device per step
    if remainder == 0 and rows > 0:
        size = largest_divisor(rows, device_batch)
        return f"pass --config.train.device_batch_size={size} ({rows} rows per device per step)"
    multiple = seq_len * batch_devices
    nearest = max(multiple, round(tokens / multiple) * multiple)
    return (
        f"pass --config.train.total_batch_tokens={nearest} (a multiple of {multiple}: whole rows "
        "on every batch device)"
    )


@dataclass(frozen=True)
class BatchLayout:
    """How the configured batch is split: steps x micro-batches x devices x rows."""

    rows_per_step: int  # global sequences per optimizer step
    accum: int  # micro-batches per step
    micro_rows: int  # global sequences per micro-batch
    rows_per_process: int  # sequences one process loads per step
    eval_rows_per_process: int

    @classmethod
    def resolve(
        cls, config: Any, plan: TrainingPlan, mesh: jax.sharding.Mesh, processes: int = 0
    ) -> BatchLayout:
        """`processes`: the processes the mesh spans, 0 for this run's (jax.process_count())."""
        seq_len = config.model.seq_len
        batch_devices = sharding.batch_size_per_step(mesh)
        micro_rows = config.train.device_batch_size * batch_devices
        tokens = plan.total_batch_tokens
        if tokens % (micro_rows * seq_len):
            raise ValueError(
                f"train.total_batch_tokens={tokens} is not a multiple of train.device_batch_size"
                f"={config.train.device_batch_size} x {batch_devices} batch devices x "
                f"model.seq_len={seq_len} = {micro_rows * seq_len} tokens per micro-batch; "
                + divisibility_fix(tokens, seq_len, batch_devices, config.train.device_batch_size)
            )
        rows = tokens // seq_len
        processes = processes or jax.process_count()
        if micro_rows % processes:
            raise ValueError(
                f"{micro_rows} rows per micro-batch do not split over {processes} processes"
            )
        return cls(rows, rows // micro_rows, micro_rows, rows // processes, micro_rows // processes)
