"""The packed sender's views of a staging slot (``PackedTransport._destinations``): made
from a plan worked out once per bucket layout, and made afresh when the layout changes."""

from __future__ import annotations

import pytest
import torch

from colo.core.buckets import plan_buckets, spec
from colo.core.interfaces import SyncContext
from colo.core.memory import StagingBudget
from colo.transports.packed import PackedTransport, slot_views, view_plan

pytestmark = pytest.mark.usefixtures("no_leftover_segments")

SPECS = [spec("a", (3, 5), "bfloat16"), spec("b", (7,), "float32"), spec("c", (2, 3, 4), "bfloat16"),
         spec("d", (1,), "uint8"), spec("e", (0, 4), "float32"), spec("big", (100,), "float32"),
         spec("s", (), "float32")]


class _IntoExtractor:
    """What ``_destinations`` asks of an extractor that writes into the caller's views."""

    extracts_into = True
    source_device = torch.device("cpu")

    def extract_range(self, *args, **kw):  # pragma: no cover - never called here
        raise AssertionError


def reference(flat: torch.Tensor, bucket) -> dict:
    """The views as the sender made them one by one before the plan (slice, type, shape)."""
    out = {}
    for e in bucket.entries:
        if e.whole:
            out[e.spec.name] = flat[e.start:e.end].view(getattr(torch, e.spec.dtype)).view(e.spec.shape)
        else:
            out[(e.spec.name, e.offset)] = flat[e.start:e.end]
    return out


def same_view(x: torch.Tensor, y: torch.Tensor) -> bool:
    return (x.dtype == y.dtype and x.shape == y.shape and x.stride() == y.stride()
            and x.data_ptr() == y.data_ptr() and x.is_contiguous() == y.is_contiguous())


@pytest.mark.parametrize("budget", [64, 256, 1 << 20])
def test_the_planned_views_are_the_slices_the_sender_made(budget):
    for bucket in plan_buckets(SPECS, budget):
        flat = torch.zeros(bucket.nbytes, dtype=torch.uint8)
        got, want = slot_views(flat, view_plan(bucket)), reference(flat, bucket)
        assert got.keys() == want.keys()
        assert all(same_view(got[k], want[k]) for k in want), bucket.index


async def test_a_new_layout_gets_new_views_of_the_same_bucket_index():
    transport = PackedTransport()
    ctx = SyncContext(step=0, weight_version=1, bucket_bytes=256, source="host", staging=StagingBudget(None))
    try:
        for budget in (64, 256):  # bucket 0 laid out anew in a larger slot
            buckets = plan_buckets(SPECS, budget)
            await transport._begin(None, ctx, buckets)
            views = transport._destinations(_IntoExtractor(), buckets[0], 0, ctx)
            want = reference(transport._slots[0].tensor, buckets[0])
            assert views.keys() == want.keys(), budget
            assert all(same_view(views[k], want[k]) for k in want), budget
            transport._close_slots(keep_kept=False)  # a new bucket size: the sender frees its buffers
    finally:
        transport._close_slots(keep_kept=False)
