"""The capacity planner: its page counts are the allocator's, its search finds the largest
batch whose compiled step fits in few compilations, and the compilers' log lines stay quiet."""

import os

import jax
import pytest
from helpers import tiny_model

from bov_jax.compile.targets import Target
from bov_jax.inference import capacity
from bov_jax.inference.allocator import PageAllocator
from bov_jax.inference.engine import Engine, EngineConfig
from bov_jax.inference.layout import CacheLayout

SIZE, LENGTH, CHUNK = 4, 64, 8  # pages of 4 tokens, 64-token sequences, chunks of 8


def most_held(layout: CacheLayout, length: int, chunk: int) -> tuple[int, ...]:
    """Per group the most pages one sequence holds as the scheduler grows it: calls of
    `chunk` tokens from 0, each releasing what its window left behind, then reserving."""
    allocator = PageAllocator(layout, [10_000] * len(layout.groups), -(-length // SIZE))
    most = [0] * len(layout.groups)
    for start in range(0, length, chunk):
        allocator.release_behind("s", start)
        assert allocator.reserve("s", min(start + chunk, length))
        most = [max(m, h) for m, h in zip(most, allocator.held("s"), strict=True)]
    return tuple(most)


@pytest.mark.parametrize("window", [5, 8, 13, 16, 64])
@pytest.mark.parametrize("chunk", [1, 3, 8])
@pytest.mark.parametrize("length", [7, 30, 64])
def test_live_pages_are_the_most_the_allocator_holds(window, chunk, length):
    spec = tiny_model("d12", depth=4, window_pattern="SSSL", short_window=window).spec
    layout = CacheLayout.build(spec, SIZE)
    want = most_held(layout, length, chunk)
    assert tuple(layout.live_pages(g, length, chunk) for g in range(len(layout.groups))) == want


def test_a_small_engine_holds_the_planned_sequences_and_refuses_the_next():
    """The sequences the planner counts in a budget, grown in step to the positions where each
    holds the most pages, with one more prefilling: every page of the planned pools in use,
    and the next sequence refused."""
    model = tiny_model("d12_bov", depth=4)
    layout = CacheLayout.build(model.spec, SIZE)
    planned = 5
    pages = layout.pages_for(planned, LENGTH, CHUNK)
    budget = capacity.pool_bytes(layout, pages) - capacity.pool_bytes(layout, [1] * len(pages))
    assert layout.sequences_within(budget + layout.sequence_bytes(LENGTH) - 1, LENGTH, CHUNK) == 5
    assert layout.sequences_within(budget - 1, LENGTH, CHUNK) == 4
    config = EngineConfig(
        page_size=SIZE, max_seqs=planned + 1, max_context=LENGTH, chunk=CHUNK, pages=pages
    )
    allocator = Engine(model, config).allocator
    decoding = [f"d{i}" for i in range(planned)]

    def decode_to(end: int, start: int) -> None:
        for n in range(start, end):
            for seq in decoding:
                allocator.release_behind(seq, n)
                assert allocator.reserve(seq, n + 1)

    decode_to(LENGTH - 1, 0)
    for start in range(0, LENGTH, CHUNK):  # the prefilling one, to its last chunk
        allocator.release_behind("prefill", start)
        assert allocator.reserve("prefill", start + CHUNK)
    decode_to(LENGTH, LENGTH - 1)
    assert [allocator.free_pages(g) for g in range(len(pages))] == [0] * len(pages)
    assert not allocator.reserve("next", 1)


def linear_peak(cost, base: int, slope: int, refused_above: int | None):
    """A compiled peak's stand-in: the known cost, a workspace a little off a line, and a
    compiler that refuses peaks past `refused_above` bytes (a TPU's past its HBM)."""
    calls, refused = [], set()

    def measure(n: int) -> int | None:
        calls.append(n)
        peak = cost(n) + base + slope * n + (n % 3) * 1000
        if refused_above is not None and peak > refused_above:
            refused.add(n)
            return None
        return peak

    return measure, calls, refused


@pytest.mark.parametrize("base, slope", [(0, 0), (5_000_000, 40_000), (200_000_000, 900_000)])
@pytest.mark.parametrize("refused_above", [None, 1_050_000_000])
def test_the_search_finds_the_largest_fitting_batch_in_few_compilations(base, slope, refused_above):
    limit = 1_000_000_000

    def cost(n: int) -> int:
        return 300_000_000 + 700_000 * n

    measure, calls, refused = linear_peak(cost, base, slope, refused_above)
    upper = (limit - cost(0)) // 700_000
    found, count = capacity.search(measure, cost, limit, upper)
    # a refused batch tells nothing of the workspace: a halving more
    assert count == len(calls) <= (4 if calls[0] not in refused else 5)
    fits = [n for n in range(upper + 1) if (p := measure(n)) is not None and p <= limit]
    assert found == max(fits)


def test_the_plan_on_the_host_cpu_counts_what_its_compiled_step_fits():
    model = tiny_model("d12_bov", depth=4)
    spec = model.spec
    device = jax.devices("cpu")[0]
    target = Target("host", "cpu", 1, 24 * 2**20, "", "h100")
    plan = capacity.plan("BoV", spec, True, target, device, LENGTH, SIZE, CHUNK, 0.1)
    layout = CacheLayout.build(spec, SIZE)
    graphdef, params = capacity.abstract_params(spec, layout, device)
    limit = int(target.hbm_bytes * 0.9)

    def peak(n: int) -> int:
        pages = layout.pages_for(n, LENGTH, CHUNK)
        step = capacity.compile_decode(graphdef, params, layout, device, n, LENGTH, pages)
        return capacity.peak_bytes(step)

    assert plan.sequences > 10 and plan.compilations <= 4
    assert plan.peak_bytes == peak(plan.sequences) <= limit < peak(plan.sequences + 1)
    assert plan.pages == layout.pages_for(plan.sequences, LENGTH, CHUNK)
    assert plan.ideal_bytes == plan.weights_bytes + plan.sequences * plan.sequence_bytes
    assert plan.ratio == pytest.approx(plan.step_bytes / plan.ideal_bytes)
    assert sum(moved for _, moved in plan.sources) <= plan.step_bytes
    assert plan.sources[0][1] >= plan.sources[-1][1] > 0


def test_quiet_keeps_the_compilers_lines_back_unless_the_block_fails(capfd):
    with capacity.quiet():
        os.write(2, b"This indicates an error in the calculation!\n")
    assert capfd.readouterr().err == ""
    with pytest.raises(RuntimeError), capacity.quiet():
        os.write(2, b"the compiler's reason\n")
        raise RuntimeError("failed")
    assert "the compiler's reason" in capfd.readouterr().err


def test_gpu_plans_name_the_memory_fraction_the_server_must_set():
    h100 = Target("h100", "gpu", 1, 84942979072, "1x1x1", "h100")
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.90" in capacity.memory_fraction(h100, 0.1)
    assert "59.3 GiB" in capacity.memory_fraction(h100, 0.1)
    v6e = Target("v6e-8", "tpu", 1, 32 * 2**30, "v6e:1x1", "v6e")
    assert "XLA_PYTHON" not in capacity.memory_fraction(v6e, 0.1)
