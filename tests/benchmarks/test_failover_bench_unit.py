"""Unit tests of the failover benchmark's recompute figures: the continuation counters by worker
and the prompt tokens in whole pages of the continued streams."""

from __future__ import annotations

from benchmarks.failover import continuation_tokens_by_worker, prompt_page_tokens

COMPUTED, CACHED = "pdserve_continuation_prefill_tokens_total", "pdserve_continuation_cached_tokens_total"


def sample(name: str, worker: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return name, (("worker", worker),)


def test_counters_by_worker_keep_the_workers_that_moved():
    before = {sample(COMPUTED, "prefill-0"): 10.0, sample(CACHED, "prefill-0"): 16.0, sample(COMPUTED, "decode-0"): 5.0}
    after = {
        sample(COMPUTED, "prefill-0"): 40.0,
        sample(CACHED, "prefill-0"): 48.0,
        sample(COMPUTED, "decode-0"): 5.0,
        sample(COMPUTED, "decode-1"): 7.0,
    }
    assert continuation_tokens_by_worker(after, before) == {
        "decode-1": {"computed": 7, "cached": 0},
        "prefill-0": {"computed": 30, "cached": 32},
    }


def test_prompt_pages_of_the_streams_resumed_after_detection_each_choice_counted():
    def record(prompt: int, resume: float | None, choices: int = 1) -> dict:
        return {"usage": {"prompt_tokens": prompt}, "resume_s": resume, "choices": dict.fromkeys(range(choices))}

    records = [record(15, 2.0), record(16, 2.0), record(40, 3.0, choices=2), record(40, 0.1), record(40, None)]
    assert prompt_page_tokens(records, 1.0, 16) == 16 + 2 * 32  # the survivor's streams and ended ones left out
    assert prompt_page_tokens(records, None, 16) == 0
