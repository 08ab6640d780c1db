"""Page allocator and host KV pool: free lists, contiguity preference, misuse detection."""

from __future__ import annotations

import pytest
import torch

from cache.host_pool import HostKVPool
from cache.page_allocator import OutOfPages, PageAllocator


def test_alloc_free_and_integrity():
    a = PageAllocator(10)
    p1 = a.alloc(4)
    assert p1 == [0, 1, 2, 3] and a.num_free() == 6 and a.num_used() == 4
    with pytest.raises(OutOfPages):
        a.alloc(7)
    assert a.num_free() == 6  # a failed alloc takes nothing
    a.free([2, 0])
    assert a.alloc(3) == [0, 2, 4]  # lowest ids first: runs stay contiguous where they can
    a.check_integrity()


def test_double_free_and_out_of_range_raise():
    a = PageAllocator(4)
    pages = a.alloc(2)
    a.free(pages)
    with pytest.raises(ValueError, match="double free"):
        a.free(pages[:1])
    with pytest.raises(ValueError, match="out of range"):
        a.free([9])
    with pytest.raises(ValueError, match="double free"):
        a.free([a.alloc(1)[0]] * 2)
    a.check_integrity()


def test_host_pool_round_trip_and_accounting():
    dev = torch.randn(12, 2, 2, 4, 2, 8)
    host = HostKVPool.for_device_pool(dev, 5 * dev[0].numel() * 4)
    assert host.num_pages == 5 and not host.can_hold(6)
    kv = host.offload(dev, [7, 8, 2], num_tokens=10)
    ref = dev[[7, 8, 2]].clone()
    host.check_integrity([kv])
    dev.zero_()
    host.load(dev, kv, [0, 1, 5])
    assert torch.equal(dev[[0, 1, 5]], ref)
    assert host.num_free() == 5 and kv.pages == []
    host.check_integrity([])
