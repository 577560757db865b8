"""A rank's spec (colo.ranks.host.RankSpec) crosses a process boundary as plain data: what it
cannot be is refused where it is made, naming the field."""

from __future__ import annotations

import pytest

from colo.ranks.host import RankSpec

BASE = dict(rank=0, world_size=2, device="cpu", trainer="hf", model_config={}, seed=0, engine_dtype="float32",
            transport="packed", trainer_init="", engine_init="", engine_build={}, task={}, workdir="/tmp",
            engine="vllm", layout="replicas")


def test_a_lora_spec_is_a_rank_and_a_count_of_versions_kept():
    spec = RankSpec(**BASE, lora={"rank": 8, "keep": 2})
    assert spec.to_json()["lora"] == {"rank": 8, "keep": 2}
    assert RankSpec(**BASE).lora is None
    for bad in ({"rank": 0, "keep": 2}, {"rank": 8}, {"rank": 8, "keep": True}, {"rank": "8", "keep": 2}, [8, 2]):
        with pytest.raises(ValueError, match="rank spec lora must be"):
            RankSpec(**BASE, lora=bad)
