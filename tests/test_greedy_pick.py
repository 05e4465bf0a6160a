"""Greedy's pick (`first_maxima`) is torch's `max(dim=-1).indices` exactly: the first of equal maxima, a NaN's index,
and any vocabulary, whole spans of FIRST_MAX_SPAN or not."""

from __future__ import annotations

import pytest
import torch

from rqbatcher.workers.engine.sampling import FIRST_MAX_SPAN, first_maxima


def torch_pick(logits: torch.Tensor) -> torch.Tensor:
    return logits.max(dim=-1).indices


@pytest.mark.parametrize("vocab", [FIRST_MAX_SPAN, 49_152, 32_000, 50_257, 300])
@pytest.mark.parametrize("rows", [1, 3, 32])
def test_random_logits_pick_torchs_index(vocab, rows):
    generator = torch.Generator().manual_seed(vocab * 100 + rows)
    logits = torch.randn(rows, vocab, generator=generator)
    assert torch.equal(first_maxima(logits), torch_pick(logits))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_equal_maxima_pick_the_first_as_torch_does(dtype):
    generator = torch.Generator().manual_seed(7)
    # a few distinct values, so every row holds its maximum many times, in several spans
    logits = torch.randint(-3, 4, (16, 4 * FIRST_MAX_SPAN), generator=generator).to(dtype)
    picked = first_maxima(logits)
    assert torch.equal(picked, torch_pick(logits))
    for row, index in zip(logits, picked.tolist()):
        assert (row[:index] < row[index]).all()


def test_ties_across_spans_and_inside_one_go_to_the_first():
    logits = torch.zeros(3, 2 * FIRST_MAX_SPAN)
    logits[0, [FIRST_MAX_SPAN + 5, 9]] = 4.0  # the earlier span's wins
    logits[1, [70, 12]] = 4.0  # inside one span: the lower index
    logits[2] = -0.0
    logits[2, 40] = 0.0  # -0 and 0 are equal: the first of them
    assert first_maxima(logits).tolist() == [9, 12, 0] == torch_pick(logits).tolist()


def test_a_row_of_minus_infinity_picks_its_first_token():
    logits = torch.full((2, FIRST_MAX_SPAN), -torch.inf)
    logits[1, 3] = 1.0
    assert first_maxima(logits).tolist() == [0, 3] == torch_pick(logits).tolist()


def test_a_nan_is_picked_where_torch_picks_it():
    logits = torch.randn(2, 2 * FIRST_MAX_SPAN)
    logits[1, 200] = torch.nan
    logits[1, 250] = torch.nan
    assert torch.equal(first_maxima(logits), torch_pick(logits))
    assert first_maxima(logits)[1].item() == 200


def test_a_row_does_not_depend_on_the_rows_beside_it():
    generator = torch.Generator().manual_seed(3)
    logits = torch.randint(-2, 3, (8, 3 * FIRST_MAX_SPAN), generator=generator).float()
    together = first_maxima(logits).tolist()
    assert together == [first_maxima(row[None]).item() for row in logits]
