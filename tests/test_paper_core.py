"""The paper's CORE restricted to the tasks we evaluate (bov_jax/evals/paper_core.py)."""

import pytest

from bov_jax.evals import paper_core
from bov_jax.evals.tasks import CORE_TASKS

ALL = [t.label for t in CORE_TASKS]
OURS = [label for label in ALL if label not in ("winograd", "agi_eval_lsat_ar")]
RUN_100B = paper_core.PAPER_RUNS[0]


def test_recorded_values_name_real_tasks_and_every_arm():
    for run in paper_core.PAPER_RUNS:
        assert run.source and len(run.core) == 2
        for label, arms in run.accuracy.items():
            assert label in ALL and set(arms) == set(run.core), (run.name, label)
        assert set(run.differences) <= set(ALL) - set(run.accuracy)


def test_over_all_21_tasks_the_restriction_is_the_paper_number():
    for row in paper_core.paper_comparison(ALL):
        assert row.restricted == pytest.approx(row.all_tasks, abs=1e-12)


def test_19_task_numbers_remove_winograd_and_lsat_from_the_paper_aggregate():
    # By hand: centered = (acc - r) / (1 - r), r = 0.5 (winograd), 0.2 (LSAT-AR).
    want = {
        "baseline": (21 * 0.334 - (0.766 - 0.5) / 0.5 - (0.300 - 0.2) / 0.8) / 19,
        "bov": (21 * 0.351 - (0.740 - 0.5) / 0.5 - (0.187 - 0.2) / 0.8) / 19,
    }
    for arm, value in want.items():
        row = paper_core.restricted_core(RUN_100B, arm, OURS)
        assert row.restricted == pytest.approx(value, abs=1e-12)
        assert row.bound == pytest.approx((21 + 1 / 0.5 + 1 / 0.8) * 0.0005 / 19)
    gain, restricted = paper_core.restricted_gain(RUN_100B, OURS)
    assert gain == pytest.approx(0.017)
    assert restricted == pytest.approx(want["bov"] - want["baseline"], abs=1e-12)
    assert restricted == pytest.approx(0.0290, abs=5e-5)  # the 19-task bias: +0.012


def test_unrecorded_tasks_give_no_number_and_are_named():
    without_arc = [label for label in OURS if label != "arc_challenge"]
    row = paper_core.restricted_core(RUN_100B, "bov", without_arc)
    assert row.restricted is None and row.unrecorded == ("arc_challenge",)
    # Only the difference is recorded for arc_challenge: the gain is still computable.
    assert paper_core.restricted_gain(RUN_100B, without_arc)[1] is not None
    flops_matched = paper_core.PAPER_RUNS[1]
    assert paper_core.restricted_gain(flops_matched, OURS)[1] is None
    text = paper_core.format_paper_comparison(OURS)
    assert "19 tasks 0.3635" in text and "21 tasks 0.351" in text
    assert "not recorded for winograd, agi_eval_lsat_ar" in text
    with pytest.raises(ValueError, match="hellaswag_zeroshot"):
        paper_core.restricted_core(RUN_100B, "bov", ["hellaswag_zeroshot"])
