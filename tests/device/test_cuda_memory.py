import os

import pytest

from colo.device.cuda_memory import Saver, refuse_expandable_segments


@pytest.mark.parametrize("var", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_expandable_segments_is_refused_with_a_clear_error(monkeypatch, var):
    monkeypatch.setenv(var, "max_split_size_mb:64, expandable_segments:True")
    with pytest.raises(ValueError, match="expandable_segments.*incompatible with torch_memory_saver"):
        Saver()
    assert "expandable_segments:True" in os.environ[var]  # refused, not silently rewritten


def test_other_allocator_settings_pass(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False,max_split_size_mb:64")
    refuse_expandable_segments()
