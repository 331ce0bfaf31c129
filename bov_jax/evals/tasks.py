"""The 21 CORE tasks (the fork's `configs/core.yaml` with the random baselines of
`eval_meta_data.csv`, reference spec 7) and the centering of an accuracy by its baseline.
Shared by the harness (`evals.core`) and the paper's numbers (`evals.paper_core`)."""

from dataclasses import dataclass
from typing import Literal

TaskType = Literal["multiple_choice", "schema", "language_modeling"]


@dataclass(frozen=True)
class CoreTask:
    """One CORE task: the core.yaml entry plus its random baseline (percent)."""

    label: str
    dataset_uri: str
    task_type: TaskType
    num_fewshot: int
    delimiter: str
    random_baseline: float
    reference_examples: int


_MC: TaskType = "multiple_choice"
_SCHEMA: TaskType = "schema"
_LM: TaskType = "language_modeling"
_ANSWER = "\nAnswer: "

CORE_TASKS: tuple[CoreTask, ...] = (
    CoreTask("jeopardy", "world_knowledge/jeopardy_all.jsonl", _LM, 10, _ANSWER, 0.0, 2117),
    CoreTask(
        "bigbench_qa_wikidata",
        "world_knowledge/bigbench_qa_wikidata.jsonl",
        _LM,
        10,
        " ",
        0.0,
        20321,
    ),
    CoreTask("arc_easy", "world_knowledge/arc_easy.jsonl", _MC, 25, _ANSWER, 25.0, 2376),
    CoreTask("arc_challenge", "world_knowledge/arc_challenge.jsonl", _MC, 25, _ANSWER, 25.0, 1172),
    CoreTask("copa", "commonsense_reasoning/copa.jsonl", _MC, 0, " ", 50.0, 100),
    CoreTask(
        "commonsense_qa", "commonsense_reasoning/commonsense_qa.jsonl", _MC, 10, " ", 20.0, 1221
    ),
    CoreTask("piqa", "commonsense_reasoning/piqa.jsonl", _MC, 10, _ANSWER, 50.0, 1838),
    CoreTask("openbook_qa", "commonsense_reasoning/openbook_qa.jsonl", _MC, 0, " ", 25.0, 500),
    CoreTask(
        "lambada_openai", "language_understanding/lambada_openai.jsonl", _LM, 0, " ", 0.0, 5153
    ),
    CoreTask("hellaswag", "language_understanding/hellaswag.jsonl", _MC, 10, " ", 25.0, 10042),
    CoreTask("winograd", "language_understanding/winograd_wsc.jsonl", _SCHEMA, 0, " ", 50.0, 273),
    CoreTask("winogrande", "language_understanding/winogrande.jsonl", _SCHEMA, 5, " ", 50.0, 1267),
    CoreTask(
        "bigbench_dyck_languages",
        "symbolic_problem_solving/bigbench_dyck_languages.jsonl",
        _LM,
        10,
        " ",
        0.0,
        1000,
    ),
    CoreTask(
        "agi_eval_lsat_ar",
        "symbolic_problem_solving/agi_eval_lsat_ar.jsonl",
        _MC,
        3,
        " ",
        20.0,
        230,
    ),
    CoreTask(
        "bigbench_cs_algorithms",
        "symbolic_problem_solving/bigbench_cs_algorithms.jsonl",
        _LM,
        10,
        " ",
        0.0,
        1320,
    ),
    CoreTask(
        "bigbench_operators",
        "symbolic_problem_solving/bigbench_operators.jsonl",
        _LM,
        10,
        " ",
        0.0,
        210,
    ),
    CoreTask(
        "bigbench_repeat_copy_logic",
        "symbolic_problem_solving/bigbench_repeat_copy_logic.jsonl",
        _LM,
        10,
        " ",
        0.0,
        32,
    ),
    CoreTask("squad", "reading_comprehension/squad.jsonl", _LM, 10, " ", 0.0, 10570),
    CoreTask("coqa", "reading_comprehension/coqa.jsonl", _LM, 0, " ", 0.0, 7983),
    CoreTask("boolq", "reading_comprehension/boolq.jsonl", _MC, 10, _ANSWER, 62.0, 3270),
    CoreTask(
        "bigbench_language_identification",
        "language_understanding/bigbench_language_identification.jsonl",
        _MC,
        10,
        " ",
        9.1,
        10000,
    ),
)
TASKS_BY_LABEL: dict[str, CoreTask] = {t.label: t for t in CORE_TASKS}


def centered_accuracy(accuracy: float, random_baseline: float) -> float:
    """(acc - r) / (1 - r) with r = random_baseline / 100."""
    r = 0.01 * random_baseline
    return (accuracy - r) / (1.0 - r)
