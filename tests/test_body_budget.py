"""The budget of request-body bytes read at once."""

from __future__ import annotations

import pytest

from mlx_serve.body_budget import BodyBudget
from mlx_serve.errors import BodiesOverloadedError


def test_a_lone_body_always_fits_and_others_wait_for_room():
    budget = BodyBudget(100)
    budget.take(80, held=0)
    budget.take(70, held=80)  # the same body growing past the limit: alone, it fits
    with pytest.raises(BodiesOverloadedError) as refused:
        budget.take(1, held=0)  # another body: 150 held by others
    assert refused.value.status_code == 429 and refused.value.closes_connection
    budget.give(150)
    budget.take(60, held=0)
    budget.take(40, held=0)  # exactly at the limit
    with pytest.raises(BodiesOverloadedError):
        budget.take(1, held=40)
    assert budget.used == 100
