"""``papermill -p SEED -1`` is refused by the setup cell (`check_parameters`), not at cell 16 of
27 where a seeded config first sees it (issue 47)."""

import pytest

from moe_lab.workbench.lab import profiles
from moe_lab.workbench.lab.profiles import check_parameters
from moe_lab.workbench.training.loop import MAX_SEED


@pytest.mark.parametrize("seed", [-1, -(2**40), 2**31, 2**64])
def test_a_seed_out_of_range_is_refused_by_the_setup_check(seed):
    with pytest.raises(ValueError) as err:
        check_parameters("smoke", seed, False)
    assert str(err.value) == f"SEED must be an integer in [0, {2**31 - 1}], got {seed}"


def test_every_seed_a_notebook_derives_stays_in_the_training_loops_range():
    low, high = profiles.SEED_RANGE
    check_parameters("smoke", low, False)
    check_parameters("smoke", high, False)
    # The notebooks derive SEED + 1, SEED + 2, SEED + s for a few s: far below the room left.
    assert low == 0 and high + 1000 <= MAX_SEED
