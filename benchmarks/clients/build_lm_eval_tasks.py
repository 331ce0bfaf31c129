"""Writes the local lm-eval tasks' data from the embedded corpus's validation shard.

    python benchmarks/clients/build_lm_eval_tasks.py [--data_dir=data/embedded] [--items=40]

Two tasks (YAML beside the data in benchmarks/clients/lm_eval_tasks/), one item per
validation document, in a seeded order that takes the three sources (State of the Union,
Jane Austen, the World English Bible) in turn:

- bov_next_sentence.jsonl (multiple_choice): `context` is up to three sentences of a
  paragraph, `choices` the sentence that follows it and three sentences of other documents,
  `gold` the index of the true one.
- bov_continue.jsonl (generate_until): `context` the same kind of passage and the first words
  of the next sentence, `target` the rest of that sentence (up to its first punctuation).

The files are committed; rerun only to change them (the order is fixed by --seed).
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
# A sentence ends at . ! or ? before a space and a capital or an opening quote, unless the
# period is a title's (Mr. Mrs. Dr. St. Ms.).
SENTENCE = re.compile(r"(?<![MD]r\.)(?<!Mrs\.)(?<![SM][ts]\.)(?<=[.!?])\s+(?=[A-Z\u201c])")


def paragraphs(text: str) -> list[list[str]]:
    """Each paragraph of four or more sentences of 10 to 300 characters, as its sentences."""
    out = []
    for block in text.split("\n\n"):
        block = " ".join(block.split())
        sentences = SENTENCE.split(block)
        if len(sentences) >= 4 and all(10 <= len(s) <= 300 for s in sentences):
            out.append(sentences)
    return out


def interleave(docs: list[tuple[str, str]], rng: random.Random) -> list[str]:
    """Documents shuffled within each source, then taken from the sources in turn."""
    by_source: dict[str, list[str]] = {}
    for text, source in docs:
        by_source.setdefault(source, []).append(text)
    queues = [rng.sample(texts, len(texts)) for _, texts in sorted(by_source.items())]
    order = []
    while any(queues):
        order += [q.pop() for q in queues if q]
    return order


def build(data_dir: Path, items: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(multiple-choice items, generation items), `items` of each."""
    (val,) = sorted(data_dir.glob("*.parquet"))[-1:]
    table = pq.read_table(val, columns=["text", "source"])
    rng = random.Random(seed)
    docs = interleave(list(zip(*(table.column(c).to_pylist() for c in ("text", "source")))), rng)
    parsed = [p for p in (paragraphs(d) for d in docs) if p]
    mc, gen = [], []
    for i, paras in enumerate(parsed):
        if len(mc) == items:
            break
        para = rng.choice(paras)
        cut = rng.randint(2, min(4, len(para) - 1))
        others = [rng.choice(rng.choice(p)) for p in rng.sample(parsed[:i] + parsed[i + 1 :], 3)]
        choices = [para[cut], *others]
        rng.shuffle(choices)
        context = " ".join(para[max(0, cut - 3) : cut])
        mc.append(dict(context=context, choices=choices, gold=choices.index(para[cut])))
        words = para[cut].split()
        head = rng.randint(2, max(2, min(6, len(words) - 3)))
        rest = re.split(r"[,.;:!?\u201d]", " ".join(words[head:]))[0].strip()
        gen.append(dict(context=f"{context} {' '.join(words[:head])}", target=rest))
    return mc, gen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data_dir", type=Path, default=HERE.parents[1] / "data" / "embedded")
    parser.add_argument("--items", type=int, default=40)
    parser.add_argument("--seed", type=int, default=52)
    args = parser.parse_args()
    out = HERE / "lm_eval_tasks"
    for name, rows in zip(
        ("bov_next_sentence", "bov_continue"), build(args.data_dir, args.items, args.seed)
    ):
        path = out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        print(f"wrote {len(rows)} items to {path}")


if __name__ == "__main__":
    main()
