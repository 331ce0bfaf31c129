"""Compares lm-eval's loglikelihoods, as the server answered them, with in-process scoring.

    python benchmarks/clients/compare_loglikelihoods.py --workdir=RUN \
        OUT/*/samples_bov_next_sentence_*.jsonl [--add_bos_token] [--max_length=2048] \
        [--tolerance=1e-4]

Each line of an lm-eval --log_samples file of a loglikelihood task holds a document's requests
(`arguments`: context, continuation) and the server's answers (`resps`: loglikelihood,
is_greedy). The tokens lm-eval sent are rebuilt as lm-eval's local-completions builds them
(TemplateLM._encode_pair: the context's trailing whitespace moves to the continuation, the
continuation's ids are those of context + continuation after the context's; an empty context
is the prefix token <|bos|>; with add_bos_token (huggingface backend only) every encoding
starts with <|bos|>; the row keeps its last max_length - 1 tokens), then scored by the run's
model in this process (the checkpoint's forward, bov_jax.evals.loading.load_logits_fn,
float32 logits, log-softmax in float64 as bov_jax.evals.core.span_nats). The project's
tokenizer stands in for the transformers folder lm-eval loaded, which gives the same ids
(tests/test_hf_tokenizer.py).

Prints every request whose |server - in-process| exceeds the tolerance, and a summary (count,
largest difference, greedy flags that disagree); exits 1 if any request exceeds it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this tree's bov_jax
from bov_jax.evals.core import span_nats, stack_rows  # noqa: E402


def encode_pair(encode, context: str, continuation: str, bos: int, add_bos: bool):
    """(context ids, continuation ids) as lm-eval's TemplateLM.loglikelihood makes them."""
    if context == "":
        return [bos], encode(continuation)
    prefix = [bos] if add_bos else []
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = prefix + encode(context + continuation)
    context_ids = prefix + encode(context)
    return context_ids, whole[len(context_ids) :]


def requests_of(path: Path) -> list[tuple[str, str, str, float, bool]]:
    """(id, context, continuation, server loglikelihood, server is_greedy) of every request."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        sample = json.loads(line)
        arguments = list(sample["arguments"].values())
        if len(arguments) != len(sample["resps"]):
            raise ValueError(f"{path}: doc {sample['doc_id']}: arguments and resps differ")
        for i, (args, resp) in enumerate(zip(arguments, sample["resps"], strict=True)):
            value, greedy = resp[0]
            rid = f"{path.stem}:{sample['doc_id']}:{i}"
            out.append((rid, args["arg_0"], args["arg_1"], float(value), greedy == "True"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("samples", type=Path, nargs="+", help="lm-eval samples_*.jsonl files")
    parser.add_argument("--workdir", required=True, help="the run the server serves")
    parser.add_argument("--step", type=int, default=None, help="checkpoint (default: latest)")
    parser.add_argument("--add_bos_token", action="store_true", help="as lm-eval's model_args")
    parser.add_argument("--max_length", type=int, default=2048, help="lm-eval's max_length")
    parser.add_argument("--tolerance", type=float, default=1e-4)
    args = parser.parse_args()

    from bov_jax.evals.loading import load_logits_fn

    step, tokenizer, logits_fn = load_logits_fn(args.workdir, args.step)
    bos, keep = tokenizer.bos_id, args.max_length - 1
    worst, over, greedy_differs, total = 0.0, 0, 0, 0
    for path in args.samples:
        requests = requests_of(path)
        for start in range(0, len(requests), 4):
            batch = requests[start : start + 4]
            rows, context_lengths = [], []
            for _, context, continuation, _, _ in batch:
                ctx, cont = encode_pair(
                    tokenizer.encode_one, context, continuation, bos, args.add_bos_token
                )
                row = (ctx + cont)[-keep:]
                rows.append(row)
                context_lengths.append(len(row) - len(cont))
            logits = np.asarray(logits_fn(stack_rows(rows, bos, 64)))
            for i, (rid, _, _, served, served_greedy) in enumerate(batch):
                row, s = np.asarray(rows[i]), context_lengths[i]
                span = logits[i, s - 1 : len(row) - 1]
                ours = -span_nats(span, row[s:])
                greedy = bool(np.array_equal(span.argmax(axis=-1), row[s:]))
                diff = abs(served - ours)
                worst, total = max(worst, diff), total + 1
                greedy_differs += greedy != served_greedy
                if diff > args.tolerance:
                    over += 1
                    print(f"{rid}: server {served:.6f} in-process {ours:.6f} diff {diff:.2e}")
    print(
        f"step {step}: {total} requests, {over} differ by more than {args.tolerance:g}; "
        f"largest difference {worst:.3e}; is_greedy differs on {greedy_differs}"
    )
    sys.exit(1 if over or not total else 0)


if __name__ == "__main__":
    main()
