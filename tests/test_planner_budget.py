"""The memory that really exists: the planner's default budget is the devices' bytes_limit, and no plan is returned
whose AOT-compiled bytes exceed the budget."""

from types import SimpleNamespace

import pytest

from openhosti_jax.demo.examples import example_inputs, gpt_step
from openhosti_jax.errors import MemoryBudgetError
from openhosti_jax.mesh import device_memory_limit
from openhosti_jax.planner import PROFILES, choose_plan
from openhosti_jax.planner import search as planner_search
from openhosti_jax.planner.search import memory_budget_for


def test_budget_is_the_runtime_limit_before_the_spec_sheet():
    h100 = PROFILES["H100"]
    limited = [SimpleNamespace(memory_stats=lambda: {"bytes_limit": 75 << 30, "bytes_in_use": 0})] * 2
    assert memory_budget_for(limited, h100, None) == (75 << 30, "the devices' bytes_limit")
    cpu = [SimpleNamespace(memory_stats=lambda: None)]
    assert device_memory_limit(cpu) is None
    assert memory_budget_for(cpu, h100, None) == (h100.memory_bytes, "the H100 spec sheet")
    assert memory_budget_for(limited, h100, 123) == (123, "given")


@pytest.mark.slow  # 6 s on the 2-core machine: too long for the fast suite
@pytest.mark.timeout(300)
def test_a_plan_that_compiles_over_the_budget_is_never_returned(monkeypatch):
    """The cost model's ranking stands; the compiled sizes are replaced by ones the budget rejects (the first two),
    or rejects altogether, so the verification loop's choice can be checked against them."""
    init_fn, tx, batch = example_inputs("gpt-tiny")
    _, free = choose_plan(init_fn, tx, batch, step_fn=gpt_step, device_profile="H100", memory_budget=2**40)
    ranked = [c.label for c in free.candidates]
    sizes = {ranked[0]: 3 * 2**30, ranked[1]: 2 * 2**30, ranked[2]: 2**20}
    real, chosen = planner_search.first_that_compiles_within, []

    def fake(candidates, compiled_bytes, budget, expand):
        def size(plan):  # candidates the ranking did not list (policy variants) compile over the budget too
            label = next((s.candidate.label for s in candidates if s.plan is plan), None)
            return sizes.get(label, 4 * 2**30)

        out = real(candidates, size, budget, expand)
        chosen.append(out[0].candidate.label)
        return out

    monkeypatch.setattr("openhosti_jax.planner.choose.first_that_compiles_within", fake)
    plan, report = choose_plan(init_fn, tx, batch, step_fn=gpt_step, device_profile="H100", memory_budget=2**30)
    assert chosen == [ranked[2]] and report.compiled_bytes == 2**20 and report.plan is plan
    assert any("compiled to 3.00 GiB > budget; trying next" in n for n in report.notes)
    sizes[ranked[2]] = 5 * 2**30
    with pytest.raises(MemoryBudgetError, match=r"no sharding compiles within .* the smallest is 2147483648 bytes"):
        choose_plan(init_fn, tx, batch, step_fn=gpt_step, device_profile="H100", memory_budget=2**30)


@pytest.mark.timeout(300)
def test_a_family_rejected_by_the_compiler_is_searched_with_remat(monkeypatch):
    """The compiler says every plan without remat needs one byte more than the budget: the planner does not give
    up after its top predictions but scores the rejected candidates' remat and microbatch variants, judges them on
    the measured excess, and returns one that the compiler accepts."""
    init_fn, tx, batch = example_inputs("gpt-tiny")
    _, free = choose_plan(init_fn, tx, batch, step_fn=gpt_step, device_profile="H100", memory_budget=2**40)
    budget = free.predicted_bytes  # the free winner just fits by prediction
    real, compiled = planner_search.first_that_compiles_within, []

    def fake(candidates, compiled_bytes, budget_, expand):
        def size(plan):
            compiled.append(plan.remat)
            return budget + 1 if plan.remat == "none" else budget // 2

        return real(candidates, size, budget_, expand)

    monkeypatch.setattr("openhosti_jax.planner.choose.first_that_compiles_within", fake)
    plan, report = choose_plan(init_fn, tx, batch, step_fn=gpt_step, device_profile="H100", memory_budget=budget)
    assert plan.remat != "none" and report.compiled_bytes == budget // 2
    assert compiled[-1] == plan.remat and compiled.count("none") >= 1
    assert len(compiled) <= planner_search.VERIFY_TRIES + 1
