"""``colo.dtypes``: one spelling of each dtype's name, whatever names it."""

from __future__ import annotations

import pytest
import torch

from colo.dtypes import as_dtype, dtype_name


def test_every_spelling_names_the_same_dtype_and_a_name_is_the_same_on_every_call():
    for dtype in (torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.uint8, torch.int64):
        want = str(dtype).removeprefix("torch.")
        # the first call fills the cache, the later ones read it: the same answer either way
        assert [dtype_name(dtype) for _ in range(2)] == [want, want]
        assert dtype_name(want) == dtype_name("torch." + want) == want
        assert as_dtype(want) is dtype and as_dtype("torch." + want) is dtype
    with pytest.raises(ValueError, match="'bfloat17' is not a torch dtype"):
        dtype_name("bfloat17")
    with pytest.raises(ValueError, match="is not a torch dtype"):
        dtype_name(None)
