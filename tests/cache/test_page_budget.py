"""``PageBudget`` (every method against hand-computed numbers, with and without an SWA pool) and
``FitCheck`` (one exception type, the messages clients read, ``param``/``code`` for the router).

The SWA numbers use page size P=4 and window W=6: ``keep_start(n) = floor4(min(n - 7, 4*(n//4) - 5))``
(0 below 0), so keep_start(5) = keep_start(10) = 0, keep_start(16) = keep_start(18) = 8,
keep_start(20) = 12, and a decoding request holds at most ``max_pages() = 3`` SWA pages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from cache.fit import SWA_POOL_EXCEEDED, FitCheck, RequestRejected
from cache.handle import KVHandle, PoolPages
from cache.kv_budget import PageBudget
from cache.kv_manager import KVManager
from cache.page_allocator import PageAllocator
from cache.page_count import PageCount
from cache.swa_window import NO_PAGE, SWAWindow

P, W = 4, 6


def budget(swa_pages: int | None = 10, radix: bool = False, full_pages: int = 20) -> PageBudget:
    """20 full pages of 4 tokens; an SWA pool of ``swa_pages`` pages (None: no SWA pool)."""
    if swa_pages is None:
        return PageBudget(KVManager(PageAllocator(full_pages), P, radix))
    return PageBudget(KVManager(PageAllocator(full_pages), P, radix, PageAllocator(swa_pages), SWAWindow(W, P)))


def handle(full: int, swa: list[int] | None = None) -> KVHandle:
    return KVHandle(full=PoolPages(pages=list(range(full))), swa=None if swa is None else PoolPages(pages=swa))


@dataclass
class Req:
    """What the budget reads of a request."""

    seq_len: int
    remaining: int
    kv: KVHandle = field(default_factory=KVHandle)
    kv_len: int = 0
    ignore_eos: bool = False

    @property
    def params(self):
        return SimpleNamespace(ignore_eos=self.ignore_eos)

    def remaining_new_tokens(self) -> int:
        return self.remaining


# ---- tokens to pages -------------------------------------------------------------------------
def test_pages_for_rounds_up_to_whole_pages():
    b = budget()
    assert [b.pages_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_window_pages_and_first_page():
    b = budget()
    assert b.window_pages == 3 and budget(None).window_pages == 0
    assert [b.window_first_page(n) for n in (5, 11, 16, 20)] == [0, 0, 2, 3]  # keep_start // 4


def test_prealloc_start_depends_on_the_radix_cache():
    assert budget().prealloc_start(22) == 16  # floor4(22 - 6)
    assert budget(radix=True).prealloc_start(22) == 12  # keep_start(22) = floor4(min(15, 15))
    assert budget(None).prealloc_start(22) == 0


def test_prefill_swa_tokens_is_one_chunk_plus_the_window():
    assert budget().prefill_swa_tokens(100, 8) == 20  # 8 + 3 pages * 4
    assert budget().prefill_swa_tokens(10, 8) == 10  # never more than the prompt
    assert budget(None).prefill_swa_tokens(100, 8) == 8


def test_swa_pages_at_once_is_at_least_the_window():
    assert budget().swa_pages_at_once(20) == 5
    assert budget().swa_pages_at_once(4) == 3
    assert budget(None).swa_pages_at_once(20) == 5


# ---- reservations ------------------------------------------------------------------------------
def test_reserved_tokens_scale_by_the_ratio_unless_ignore_eos():
    assert PageBudget.reserved_tokens(Req(5, remaining=10), 0.35) == 4  # ceil(3.5)
    assert PageBudget.reserved_tokens(Req(5, remaining=10, ignore_eos=True), 0.35) == 10
    assert PageBudget.reserved_tokens(Req(5, remaining=0), 1.0) == 0


def test_decode_growth_full_to_the_end_swa_to_the_window():
    b = budget()
    # kv_len 18 + 7 -> 7 pages, 5 held: 2 full; window pages 2.. -> min(3, 7 - 2) = 3, 2 held -> 1
    h = handle(5, [NO_PAGE, NO_PAGE, NO_PAGE, 11, 12])
    assert b.decode_growth(h, 18, 7) == PageCount(2, 1)
    assert b.decode_growth(handle(5, [NO_PAGE, NO_PAGE, 10, 11, 12]), 18, 7) == PageCount(2, 0)
    # short request: 7 tokens -> 2 pages, all held; its window spans only those 2
    assert b.decode_growth(handle(2, [0, 1]), 5, 2) == PageCount(0, 0)
    assert budget(None).decode_growth(handle(5), 18, 7) == PageCount(2)


def test_prompt_growth_of_a_prefilled_prompt():
    b = budget()
    assert b.prompt_growth(5, 10) == PageCount(2, 1)  # 4 - 2 pages; window 3 - 2 held
    assert b.prompt_growth(18, 7) == PageCount(2, 0)  # 7 - 5 pages; 5 - 2 held = 3 = window
    assert budget(None).prompt_growth(5, 10) == PageCount(2)
    assert b.prompt_growth(8, 0) == PageCount(0, 1)  # no new token, but the window: 3 - 2 held


def test_prompt_reservation_from_seq_len_or_a_shorter_transfer():
    b, req = budget(), Req(5, remaining=10)
    assert b.prompt_reservation(req, 0.5) == PageCount(1, 1)  # prompt_growth(5, 5)
    assert b.prompt_reservation(req, 0.5, n_tokens=4) == PageCount(2, 2)  # prompt_growth(4, 6)
    assert budget(None).prompt_reservation(req, 0.5) == PageCount(1)


def test_running_reservation_and_headroom():
    b = budget()
    running = [
        Req(18, remaining=14, kv=handle(5, [NO_PAGE, NO_PAGE, NO_PAGE, 11, 12])),  # growth(18, 7)
        Req(5, remaining=4, kv=handle(2, [0, 1])),
    ]  # growth(5, 2)
    assert b.running_reservation(running, 0.5) == PageCount(2, 1)
    assert b.running_reservation([], 0.5) == PageCount()
    assert b.headroom(running, 0.5) == PageCount(18, 9)  # empty pools: 20 and 10 pages
    assert budget(None).headroom([Req(18, remaining=14, kv=handle(5))], 0.5) == PageCount(18)


# ---- decode steps and retract --------------------------------------------------------------------
def test_decode_need_is_the_next_steps_pages():
    b = budget()
    reqs = [
        Req(20, 0, kv=handle(5, [0, 1, 2, 3, 4]), kv_len=19),  # 21 tokens -> 6 pages: 1 + 1
        Req(20, 0, kv=handle(5, [0, 1, 2, 3, 4]), kv_len=18),
    ]  # 20 tokens -> 5 pages: none
    assert b.decode_need(reqs, 2) == PageCount(1, 1)
    assert b.decode_need(reqs, 6) == PageCount(3, 3)  # 25 and 24 tokens: 7 and 6 pages
    assert budget(None).decode_need([Req(20, 0, kv=handle(5), kv_len=19)], 2) == PageCount(1)


def test_resume_need_caps_full_pages_at_the_pool():
    b = budget()
    assert b.resume_need(18, 3, 3) == PageCount(6, 3)
    assert b.resume_need(100, 3, 2) == PageCount(20, 2)  # 26 pages capped at the 20 of the pool


def test_fits_beside_the_running_reserve():
    b = budget()
    running = [Req(20, 0, kv=handle(5, [0, 1, 2, 3, 4]), kv_len=19)]  # reserve (1, 1) for 2 steps
    assert b.fits_beside(running, 2, PageCount(19, 9))
    assert not b.fits_beside(running, 2, PageCount(20, 0))
    assert not b.fits_beside(running, 2, PageCount(0, 10))
    assert b.fits_beside([], 2, PageCount(20, 10))


def test_fits_alone_in_the_empty_pools():
    assert budget().fits_alone(80) and not budget().fits_alone(81)  # 20 pages of 4 tokens
    assert not budget(swa_pages=2).fits_alone(4)  # window needs 3 SWA pages
    assert budget(None).fits_alone(80)


def test_pool_sizes_and_purity():
    b = budget()
    assert b.swa_pool_pages == 10 and budget(None).swa_pool_pages is None
    h = handle(5, [NO_PAGE, NO_PAGE, NO_PAGE, 11, 12])
    before = (list(h.full.pages), list(h.swa.pages), b.kv.available())
    assert b.decode_growth(h, 18, 7) == b.decode_growth(h, 18, 7)
    assert (h.full.pages, h.swa.pages, b.kv.available()) == before


# ---- FitCheck ----------------------------------------------------------------------------------
def test_fit_check_request_messages_and_fields():
    fit = FitCheck(64, 512)
    fit.request(54, 10)
    with pytest.raises(RequestRejected, match="prompt is empty; send at least one token") as e:
        fit.request(0, 10)
    assert (e.value.param, e.value.code) == ("prompt", None)
    with pytest.raises(RequestRejected) as e:
        fit.request(60, 500)
    assert str(e.value) == (
        "prompt (60 tokens) + max_tokens (500) = 560 exceeds the model context of 512 tokens; "
        "shorten the prompt or lower max_tokens"
    )
    assert (e.value.param, e.value.code) == ("max_tokens", "context_length_exceeded")
    with pytest.raises(RequestRejected) as e:
        FitCheck(64, 512, "decode KV cache pool").request(60, 10)
    assert str(e.value) == (
        "prompt (60 tokens) + max_tokens (10) = 70 exceeds the decode KV cache pool capacity of "
        "64 tokens; lower max_tokens or start the worker with a larger --kv-pool-tokens"
    )
    assert (e.value.param, e.value.code) == ("max_tokens", "kv_pool_capacity_exceeded")


def test_fit_check_router_wording():
    with pytest.raises(RequestRejected, match="start the server with a larger --kv-pool-tokens"):
        FitCheck(64, 512, restart="server").request(60, 10)


def test_fit_check_prompt_alone_for_prefill():
    fit = FitCheck(64, 32)
    fit.prompt(64)  # the context is the decode side's check
    with pytest.raises(RequestRejected) as e:
        fit.prompt(65)
    assert str(e.value) == (
        "prompt (65 tokens) exceeds the prefill worker's KV pool of 64 tokens; start it with a larger --kv-pool-tokens"
    )
    with pytest.raises(RequestRejected, match="prompt is empty"):
        fit.prompt(0)


def test_fit_check_swa_pool():
    fit = FitCheck(64, 512, swa_pool_pages=4, page_size=4)
    fit.request(10, 10, swa_pages=4)
    with pytest.raises(RequestRejected) as e:
        fit.request(10, 10, swa_pages=5)
    assert str(e.value) == (
        "this request needs 5 pages of the sliding-window KV pool at once, which has 4 (16 "
        "tokens); shorten the prompt or start the worker with a larger --swa-pool-tokens"
    )
    assert e.value.code == SWA_POOL_EXCEEDED
    FitCheck(64, 512).request(10, 10, swa_pages=99)  # no SWA pool: nothing to check


def test_budget_and_fit_check_agree_on_the_swa_window():
    b = budget(swa_pages=2)
    fit = FitCheck(80, 512, swa_pool_pages=b.swa_pool_pages, page_size=P)
    with pytest.raises(RequestRejected, match="needs 3 pages"):
        fit.request(4, 1, b.swa_pages_at_once(4))
    assert not b.fits_alone(5)
