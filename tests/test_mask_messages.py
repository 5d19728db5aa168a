"""Issue 36, item 13: the left-padding error shows the part of the mask where its 1s start, not only its zeros."""

import pytest
import torch

from lightning_accum.sequences import PaddedSequences


def test_a_long_left_padded_row_is_shown_where_it_turns_to_one():
    mask = torch.ones(2, 44, dtype=torch.long)
    mask[1, :40] = 0  # sample 1: 40 positions of left padding
    batch = {"input_ids": torch.zeros(2, 44, dtype=torch.long), "attention_mask": mask}
    with pytest.raises(ValueError, match=r"sample 1 .* left-padded .*positions 32-43: \[0, 0, 0, 0, 0, 0, 0, 0, 1, 1"):
        PaddedSequences(mask="attention_mask").cut(batch)
