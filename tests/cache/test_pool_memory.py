"""The KV pool's storage is advised onto transparent huge pages on the CPU (cache/pool_memory.py)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cache.pool_memory import HUGE_PAGE, advise_huge_pages, zeroed

pytestmark = pytest.mark.unit

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str:
    text = THP.read_text() if THP.exists() else "[never]"
    return text[text.index("[") + 1 : text.index("]")]


def _huge_kib(t: torch.Tensor) -> int:
    """AnonHugePages (KiB) of the mappings that overlap ``t``'s storage, from /proc/self/smaps."""
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < end and hi > start
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1])
    return total


def test_zeroed_is_zero_with_the_shape_and_dtype():
    t = zeroed((3, 5, 7), torch.bfloat16, "cpu")
    assert t.shape == (3, 5, 7) and t.dtype == torch.bfloat16 and not t.any()


def test_small_tensor_is_left_alone():
    assert advise_huge_pages(torch.empty(HUGE_PAGE // 8, dtype=torch.uint8)) is False


_FRESH_POOL = """
import sys
sys.path.insert(0, {root!r})
import torch
from cache.kv_pool import KVPool
from tests.cache.test_pool_memory import _huge_kib
pool = KVPool(num_pages=512, num_layers=8, page_size=16, num_kv_heads=4, head_dim=64,
              dtype=torch.float32, device="cpu")  # 64 MiB
assert not pool.buffer.any()
print(_huge_kib(pool.buffer))
"""


@pytest.mark.skipif(_thp_mode() == "never", reason="transparent huge pages are off on this host")
def test_pool_storage_lands_on_huge_pages():
    # a fresh process, as a worker allocates its pool: in a long test process the allocator may hand
    # back heap memory that earlier tests already faulted in as 4 KiB pages
    root = str(Path(__file__).resolve().parents[2])
    out = subprocess.run(
        [sys.executable, "-c", _FRESH_POOL.format(root=root)], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    # the kernel may still leave some 4 KiB pages (fragmentation); most of 64 MiB must be huge
    assert int(out.split()[-1]) >= 32 << 10
