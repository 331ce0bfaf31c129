"""CORE evaluation harness (reference spec 7; `nanochat/core_eval.py`, `scripts/base_eval.py`).

Reads the DCLM eval-bundle layout, `<bundle>/eval_data/<category>/<task>.jsonl`, with the task
table below standing in for the fork's `configs/core.yaml` (21 tasks; ARC 25-shot, winogrande
5-shot) and the random baselines of `eval_meta_data.csv`. The bundle itself is built offline by
`python -m bov_jax.evals.bundle` (see docs/core.md).

Per task: load the jsonl, shuffle with random.Random(1337), truncate to `max_per_task` (> 0). For
example idx, few-shot examples are random.Random(1234 + idx).sample of the other indices. Every
prompt of one example is encoded with BOS prepended and the prompts are right-padded with BOS into
one (B, T) batch for a single forward:

- multiple_choice: one prompt per choice; the scored span starts at the common token prefix.
- schema: one prompt per context option; the scored span is the common token suffix.
- language_modeling: prompts without / with the continuation; the span is [len(without), len(with)).

MC / schema score = sum of the span's token losses / max(1, UTF-8 bytes of the decoded span)
(the fork's byte normalisation); the argmin is the prediction. LM is correct iff the argmax at
every span position equals the continuation token. Accuracy is centered with the task's random
baseline r (percent): (acc - r/100) / (1 - r/100); CORE is the mean of the centered values over the
tasks that were available.

Results belong to the run: `python -m bov_jax.evals.core --workdir=RUN` (and the trainer, with
`train.core_at_end`) writes them to RUN/evals/core_step<N>.json, N the checkpoint's step.
"""

import json
import logging
import math
import os
import random
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from absl import flags

from bov_jax import cli
from bov_jax.errors import UserError
from bov_jax.evals.paper_core import format_paper_comparison
from bov_jax.evals.progress import Progress
from bov_jax.evals.tasks import CORE_TASKS, TASKS_BY_LABEL, CoreTask, TaskType, centered_accuracy
from bov_jax.files import write_json_atomic

logger = logging.getLogger("bov_jax.evals.core")  # not __main__ under python -m

LogitsFn = Callable[[np.ndarray], Any]
"""Model forward: tokens (B, T) int32 -> logits (B, T, V) float32, a numpy or jax array."""

DEFAULT_BUNDLE_DIR = Path(
    os.environ.get("BOV_EVAL_BUNDLE", "~/.cache/bov_jax/eval_bundle")
).expanduser()
DEFAULT_PAD_MULTIPLE = 128
DATA_SHUFFLE_SEED = 1337
FEWSHOT_SEED = 1234


class Tokenizer(Protocol):
    """What the harness needs from a tokenizer."""

    bos_id: int

    def encode_one(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


# ---------------------------------------------------------------------------------------------
# Prompt rendering (the reference's Jinja templates, written out). Each few-shot block is
# followed by exactly "\n\n".


def render_prompts_mc(
    item: dict[str, Any], delimiter: str, fewshot: Sequence[dict[str, Any]] = ()
) -> list[str]:
    """One prompt per choice: [shots] query + delimiter + choice."""
    shots = "".join(f"{ex['query']}{delimiter}{ex['choices'][ex['gold']]}\n\n" for ex in fewshot)
    return [f"{shots}{item['query']}{delimiter}{choice}" for choice in item["choices"]]


def render_prompts_schema(
    item: dict[str, Any], delimiter: str, fewshot: Sequence[dict[str, Any]] = ()
) -> list[str]:
    """One prompt per context option: [shots] option + delimiter + continuation."""
    shots = "".join(
        f"{ex['context_options'][ex['gold']]}{delimiter}{ex['continuation']}\n\n" for ex in fewshot
    )
    return [f"{shots}{ctx}{delimiter}{item['continuation']}" for ctx in item["context_options"]]


def render_prompts_lm(
    item: dict[str, Any], delimiter: str, fewshot: Sequence[dict[str, Any]] = ()
) -> list[str]:
    """[prompt without continuation (whitespace-stripped), prompt with continuation].

    Contexts are trimmed; stripping the first prompt drops a trailing delimiter space so that its
    tokens are a prefix of the second prompt's tokens.
    """
    shots = "".join(f"{ex['context'].strip()}{delimiter}{ex['continuation']}\n\n" for ex in fewshot)
    without = f"{shots}{item['context'].strip()}{delimiter}"
    return [without.strip(), without + item["continuation"]]


def sample_fewshot(idx: int, num_examples: int, num_fewshot: int) -> list[int]:
    """Indices of the few-shot examples of example idx: Random(1234 + idx).sample of the others.

    The count is clamped to num_examples - 1 (the reference raises there instead).
    """
    k = min(num_fewshot, num_examples - 1)
    if k <= 0:
        return []
    others = [i for i in range(num_examples) if i != idx]
    return random.Random(FEWSHOT_SEED + idx).sample(others, k)


# ---------------------------------------------------------------------------------------------
# Tokenisation and spans.


def common_prefix_length(seqs: Sequence[Sequence[int]]) -> int:
    """Length of the token prefix shared by all sequences."""
    n = min(len(s) for s in seqs)
    for i in range(n):
        if any(s[i] != seqs[0][i] for s in seqs):
            return i
    return n


def common_suffix_length(seqs: Sequence[Sequence[int]]) -> int:
    """Length of the token suffix shared by all sequences."""
    return common_prefix_length([s[::-1] for s in seqs])


def tokenize_example(
    task_type: TaskType, prompts: Sequence[str], tokenizer: Tokenizer
) -> tuple[list[list[int]], list[int], list[int]]:
    """Encode the prompts with BOS and find the scored span [start, end) of each row.

    Returns (rows, starts, ends); LM tasks return the single prompt with the continuation.
    """
    tokens = [[tokenizer.bos_id, *tokenizer.encode_one(p)] for p in prompts]
    ends = [len(t) for t in tokens]
    if task_type == "multiple_choice":
        start = common_prefix_length(tokens)
        return tokens, [start] * len(tokens), ends
    if task_type == "schema":
        suffix = common_suffix_length(tokens)
        return tokens, [e - suffix for e in ends], ends
    if task_type == "language_modeling":
        without, with_cont = tokens
        if len(without) >= len(with_cont) or with_cont[: len(without)] != without:
            raise ValueError("LM prompt without the continuation must tokenize to a prefix")
        return [with_cont], [len(without)], [len(with_cont)]
    raise ValueError(f"unknown task type {task_type!r}")


def stack_rows(rows: Sequence[Sequence[int]], pad_id: int, pad_multiple: int = 1) -> np.ndarray:
    """Right-pad rows with pad_id into (B, T) int32, T rounded up to a multiple of pad_multiple.

    Extra right padding leaves a causal model's logits at earlier positions unchanged; it only
    bounds the number of distinct shapes a jitted forward sees.
    """
    longest = max(len(r) for r in rows)
    width = -(-longest // pad_multiple) * pad_multiple
    out = np.full((len(rows), width), pad_id, dtype=np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


# ---------------------------------------------------------------------------------------------
# Scoring.


def span_nats(span_logits: np.ndarray, targets: np.ndarray) -> float:
    """Sum of the cross-entropies (nats) of targets (n,) under span_logits (n, V)."""
    x = np.asarray(span_logits, dtype=np.float64)
    if x.shape[0] == 0:
        return 0.0
    m = x.max(axis=-1)
    lse = m + np.log(np.exp(x - m[:, None]).sum(axis=-1))
    return float((lse - x[np.arange(x.shape[0]), targets]).sum())


def evaluate_example(
    idx: int,
    data: Sequence[dict[str, Any]],
    task: CoreTask,
    tokenizer: Tokenizer,
    logits_fn: LogitsFn,
    pad_multiple: int = 1,
) -> bool:
    """Whether the model gets example idx of the (shuffled, truncated) task data right."""
    item = data[idx]
    fewshot = [data[i] for i in sample_fewshot(idx, len(data), task.num_fewshot)]
    render = {
        "multiple_choice": render_prompts_mc,
        "schema": render_prompts_schema,
        "language_modeling": render_prompts_lm,
    }[task.task_type]
    prompts = render(item, task.delimiter, fewshot)
    rows, starts, ends = tokenize_example(task.task_type, prompts, tokenizer)
    ids = stack_rows(rows, tokenizer.bos_id, pad_multiple)
    logits = logits_fn(ids)  # sliced before any host transfer: only the spans are fetched
    if task.task_type == "language_modeling":
        s, e = starts[0], ends[0]
        predicted = np.asarray(logits[0, s - 1 : e - 1]).argmax(axis=-1)
        return bool(np.array_equal(predicted, ids[0, s:e]))
    scores = []
    for i, (s, e) in enumerate(zip(starts, ends, strict=True)):
        nats = span_nats(logits[i, s - 1 : e - 1], ids[i, s:e])  # position t predicts t + 1
        num_bytes = len(tokenizer.decode(rows[i][s:e]).encode("utf-8"))
        scores.append(nats / max(1, num_bytes))
    return int(np.argmin(scores)) == item["gold"]


def evaluate_task(
    data: Sequence[dict[str, Any]],
    task: CoreTask,
    tokenizer: Tokenizer,
    logits_fn: LogitsFn,
    pad_multiple: int = 1,
    progress: Progress | None = None,
) -> float:
    """Accuracy of the model over all examples of `data` (already shuffled and truncated)."""
    correct = 0
    for i in range(len(data)):
        correct += evaluate_example(i, data, task, tokenizer, logits_fn, pad_multiple)
        if progress is not None:
            progress.update()
    return correct / len(data)


def load_task_data(
    bundle_dir: str | Path, task: CoreTask, max_per_task: int = -1
) -> list[dict[str, Any]] | None:
    """The task's examples, shuffled with Random(1337) and truncated; None if the file is absent."""
    path = Path(bundle_dir) / "eval_data" / task.dataset_uri
    if not path.is_file():
        return None
    with path.open(encoding="utf-8") as f:
        data = [json.loads(line) for line in f if line.strip()]
    random.Random(DATA_SHUFFLE_SEED).shuffle(data)
    if max_per_task > 0:
        data = data[:max_per_task]
    return data


def select_tasks(tasks: Iterable[str] | None) -> list[CoreTask]:
    """CORE tasks in table order, restricted to the given labels (all 21 when None)."""
    if tasks is None:
        return list(CORE_TASKS)
    wanted = set(tasks)
    unknown = wanted - TASKS_BY_LABEL.keys()
    if unknown:
        raise ValueError(f"unknown CORE tasks: {sorted(unknown)}")
    return [t for t in CORE_TASKS if t.label in wanted]


def evaluate_core(
    bundle_dir: str | Path,
    tokenizer: Tokenizer,
    logits_fn: LogitsFn,
    max_per_task: int = -1,
    tasks: Iterable[str] | None = None,
    pad_multiple: int = DEFAULT_PAD_MULTIPLE,
) -> dict[str, Any]:
    """Run every selected task whose jsonl is in the bundle.

    Returns a dict with `results` (accuracy per task), `centered_results`, `num_examples`,
    `core_metric` (mean centered accuracy over the available tasks; nan if none), `num_tasks`
    (available), `num_tasks_total` (selected), `missing_tasks` (labels not in the bundle) and
    `max_per_task`. Logs each task's line and, every 10 s, the examples done with an ETA.
    """
    selected = select_tasks(tasks)
    results: dict[str, float] = {}
    centered: dict[str, float] = {}
    num_examples: dict[str, int] = {}
    missing: list[str] = []
    loaded = [(task, load_task_data(bundle_dir, task, max_per_task)) for task in selected]
    progress = Progress("CORE examples", sum(len(d) for _, d in loaded if d), logger)
    for task, data in loaded:
        if not data:
            logger.info("%s: not in the bundle, skipped", task.label)
            missing.append(task.label)
            continue
        t0 = time.perf_counter()
        acc = evaluate_task(data, task, tokenizer, logits_fn, pad_multiple, progress)
        results[task.label] = acc
        centered[task.label] = centered_accuracy(acc, task.random_baseline)
        num_examples[task.label] = len(data)
        logger.info(
            "%s (%d-shot, %s, n=%d): accuracy %.4f | centered %.4f | %.1fs",
            task.label,
            task.num_fewshot,
            task.task_type,
            len(data),
            acc,
            centered[task.label],
            time.perf_counter() - t0,
        )
    core = sum(centered.values()) / len(centered) if centered else math.nan
    return {
        "results": results,
        "centered_results": centered,
        "num_examples": num_examples,
        "core_metric": core,
        "num_tasks": len(centered),
        "num_tasks_total": len(selected),
        "missing_tasks": missing,
        "max_per_task": max_per_task,
    }


def bundle_present(bundle_dir: str | Path) -> bool:
    return (Path(bundle_dir) / "eval_data").is_dir()


def results_path(workdir: str | Path, step: int) -> Path:
    return Path(workdir) / "evals" / f"core_step{step}.json"


def write_results(workdir: str | Path, step: int, results: dict[str, Any]) -> Path:
    """Write an `evaluate_core` result, with its step, to RUN/evals/core_step<step>.json."""
    path = results_path(workdir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, {"step": step, **results})
    return path


def evaluate_into_workdir(
    workdir: str | Path,
    step: int,
    tokenizer: Tokenizer,
    logits_fn: LogitsFn,
    max_per_task: int,
    bundle_dir: str | Path = DEFAULT_BUNDLE_DIR,
) -> Path | None:
    """CORE of a run's model at `step`, written into the workdir; None (one warning) when
    there is no bundle at `bundle_dir`."""
    if not bundle_present(bundle_dir):
        logger.warning(
            "CORE skipped: no eval bundle at %s (build one with `python -m bov_jax.evals.bundle "
            "--out %s`, or point BOV_EVAL_BUNDLE at one)",
            bundle_dir,
            bundle_dir,
        )
        return None
    results = evaluate_core(bundle_dir, tokenizer, logits_fn, max_per_task)
    path = write_results(workdir, step, results)
    logger.info("CORE %.4f at step %d -> %s", results["core_metric"], step, path)
    return path


_TYPE_SHORT = {"multiple_choice": "MC", "schema": "schema", "language_modeling": "LM"}


def format_core_table(results: dict[str, Any]) -> str:
    """Per-task table (accuracy, centered) and the aggregate line of an `evaluate_core` result."""
    labels = [*results["results"], *results["missing_tasks"]]
    order = {t.label: i for i, t in enumerate(CORE_TASKS)}
    width = max(len(label) for label in [*labels, "Task"])
    lines = [f"{'Task':<{width}}  {'Type':<6}  Shots  {'N':>6}  Accuracy  Centered"]
    for label in sorted(labels, key=order.__getitem__):
        task = TASKS_BY_LABEL[label]
        head = f"{label:<{width}}  {_TYPE_SHORT[task.task_type]:<6}  {task.num_fewshot:>5}"
        if label in results["results"]:
            lines.append(
                f"{head}  {results['num_examples'][label]:>6}  {results['results'][label]:>8.4f}"
                f"  {results['centered_results'][label]:>8.4f}"
            )
        else:
            lines.append(f"{head}  {'-':>6}  {'missing':>8}  {'-':>8}")
    summary = (
        f"CORE {results['core_metric']:.4f} (mean centered accuracy over "
        f"{results['num_tasks']} of {results['num_tasks_total']} tasks"
    )
    if results["missing_tasks"]:
        summary += f"; missing: {', '.join(results['missing_tasks'])}"
    lines.append(summary + ")")
    return "\n".join(lines)


def define_flags() -> None:
    """The command's flags (defined only when run, so that importing this module defines none)."""
    flags.DEFINE_string("workdir", None, "Training workdir with the checkpoint.", required=True)
    flags.DEFINE_string("bundle_dir", str(DEFAULT_BUNDLE_DIR), "Eval bundle.")
    flags.DEFINE_integer("max_per_task", -1, "Examples per task (-1: all).")
    flags.DEFINE_list("tasks", [], "Task labels, comma-separated (default: all).")
    flags.DEFINE_integer(
        "pad_multiple",
        DEFAULT_PAD_MULTIPLE,
        "Pad sequence lengths to a multiple of this (fewer compilations).",
    )
    flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
    flags.DEFINE_string("output", "", "Also write the results as JSON here.")
    for name in ("bundle_dir", "max_per_task", "pad_multiple"):
        flags.DEFINE_alias(name.replace("_", "-"), name)


def main(argv: list[str]) -> None:
    """CLI: evaluate a checkpoint on every available CORE task, print the table and write it
    to WORKDIR/evals/core_step<N>.json."""
    del argv  # no positional arguments (cli.run checks)
    args = flags.FLAGS
    cli.log_plainly(logging.WARNING)  # quiet orbax / absl
    logging.getLogger("bov_jax").setLevel(logging.INFO)
    from bov_jax.evals.loading import load_config, load_logits_fn

    load_config(args.workdir)  # the workdir first: a missing one is the first thing to fix
    if not bundle_present(args.bundle_dir):
        raise UserError(
            f"no CORE bundle at {args.bundle_dir}; build one with "
            f"`python -m bov_jax.evals.bundle --out {args.bundle_dir}`"
        )
    step, tokenizer, logits_fn = load_logits_fn(args.workdir, args.step)
    results = evaluate_core(
        args.bundle_dir,
        tokenizer,
        logits_fn,
        args.max_per_task,
        args.tasks or None,
        args.pad_multiple,
    )
    print(format_core_table(results))
    if results["num_tasks"]:
        print(format_paper_comparison(results["centered_results"]))
    print(f"wrote {write_results(args.workdir, step, results)}")
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    define_flags()
    cli.run(main)
