"""The recipe table states the kernel's contract: every plan a recipe builds applies only the steps its row lists.

For every row of ``recipes.RECIPES``, every engine profile, gated and non-gated layers, with and without
padding, the step kinds of the weights' and the scales' maps of ``plan_layer`` are read off the plan
(``LayerPlan.tensor_steps``) and must appear in the row's ``weights`` / ``scales``, in the row's order.
A sizes pair a profile refuses is skipped (its refusal is ``shapes.padded_shape``'s, tested elsewhere);
each row must build under at least one profile.
"""

from __future__ import annotations

import pytest

from fimoe_lab import engines, recipes
from fimoe_lab.errors import FimoeError
from fimoe_lab.steps import STEPS

SIZES = [(256, 512), (200, 512), (512, 768)]  # whole blocks; 200: pads (FP8 per-tensor, BF16, FP4 defaults)


def _in_order(kinds: list[str], allowed: tuple[str, ...]) -> bool:
    """``kinds`` is a subsequence of ``allowed`` (each step at most once, in the row's order)."""
    rest = iter(allowed)
    return all(any(k == a for a in rest) for k in kinds)


@pytest.mark.parametrize("rid", list(recipes.RECIPES))
def test_every_plan_applies_only_its_rows_steps_in_order(rid):
    row = recipes.RECIPES[rid]
    assert set(row.weights) | set(row.scales) <= set(STEPS), f"{rid}: a step kind that steps.STEPS lacks"
    built = 0
    for engine in engines.ENGINES:
        for gated in (True, False):
            for inter, hidden in SIZES:
                try:
                    plan = recipes.plan_layer(row.fmt, row.backend, inter, hidden, gated, gated, engine=engine)
                except FimoeError:
                    continue
                built += 1
                for name, allowed in (("w13", row.weights), ("w2", row.weights)):
                    kinds = [s["kind"] for s in plan.tensor_steps(name)]
                    assert _in_order(kinds, allowed), f"{rid} {engine} {name}: {kinds} not within {allowed}"
                for name in ("w13_scale", "w2_scale"):
                    kinds = [s["kind"] for s in plan.tensor_steps(name)]
                    assert _in_order(kinds, row.scales), f"{rid} {engine} {name}: {kinds} not within {row.scales}"
    assert built, f"{rid}: no profile builds any of {SIZES}"


def test_in_order_refuses_a_step_out_of_order_or_missing():
    """The order check itself can fail: a swap after the shuffle, or a step the row lacks."""
    row = ("pad_projections", "swap_w13_to_w31_rows", "shuffle_rows_for_epilogue")
    assert _in_order(["pad_projections", "shuffle_rows_for_epilogue"], row)
    assert not _in_order(["shuffle_rows_for_epilogue", "swap_w13_to_w31_rows"], row)
    assert not _in_order(["block_major_k"], row)
