"""A decode worker's turn order: what it has to send (a landed request's first token, KV
destinations, migration offers) leaves before the step's forward, and the decode runs the next
turn (``DecodeScheduler.step``), never two turns in a row without it while requests run."""

from __future__ import annotations


def test_decode_worker_answers_the_first_token_before_its_next_decode_step(tiny):
    """The landing turn sends the manifest's first token alone; the decode step (token 2) is the
    next turn's, so PD's time to first token never includes a decode step."""
    from bench.harness.pd_harness import PDHarness
    from configs.schema import PdserveConfig
    from transfer.wire.sampling_params import SamplingParams

    cfg = PdserveConfig.model_validate(
        {"engine": {"kv_pool_tokens": 1024, "page_size": 4}, "cluster": {"mode": "pd", "transfer_backend": "loopback"}}
    )
    h = PDHarness(cfg, cfg, tiny[0], tiny[1])
    try:
        h.submit("r", list(range(1, 13)), SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))
        per_step = []
        while h.busy:
            got = [t for d in h.step() if d.rid == "r" for t in d.token_ids]
            if got:
                per_step.append(len(got))
        assert per_step == [1, 1, 1, 1]
        h.check_clean()
    finally:
        h.close()


def test_decode_worker_sends_kv_destinations_before_its_next_decode_step(tiny):
    """A step whose admission sends a ``KVDestination`` (or any control message) returns before its
    forward: the prefill worker starts writing a decode step sooner. The decode runs the next turn,
    so no two steps in a row skip it while requests run (a step right after a skipped one decodes
    and sends after its forward)."""
    from bench.harness.pd_harness import PDHarness
    from configs.schema import PdserveConfig
    from transfer.wire.protocol import KVDestination
    from transfer.wire.sampling_params import SamplingParams

    cfg = PdserveConfig.model_validate(
        {"engine": {"kv_pool_tokens": 1024, "page_size": 4}, "cluster": {"mode": "pd", "transfer_backend": "loopback"}}
    )
    h = PDHarness(cfg, cfg, tiny[0], tiny[1])
    try:
        steps, real_step, real_decode = [], h.decode.step, h.decode._decode
        decoded = []

        def decode(*a, **kw):
            decoded.append(True)
            return real_decode(*a, **kw)

        def step():
            decoded.clear()
            running, skipped_last = len(h.decode.running), h.decode._decode_deferred
            report = real_step()
            sent = any(isinstance(m.msg, KVDestination) for m in report.outbox.messages)
            steps.append((running, sent, bool(decoded), skipped_last))
            return report

        h.decode.step, h.decode._decode = step, decode
        h.submit("a", list(range(1, 13)), SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
        while not h.decode.running:
            h.step()
        for _ in range(3):  # a decodes every step now
            h.step()
        h.submit("b", list(range(20, 32)), SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))
        while h.busy:
            h.step()
        h.check_clean()
    finally:
        h.close()
    assert any(running and sent for running, sent, _, _ in steps), steps  # b's destination went while a ran
    assert all(skipped_last for _, sent, ran, skipped_last in steps if sent and ran), steps
    assert any(sent and not ran for _, sent, ran, _ in steps), steps
    skipped = [k for k, (running, _, ran, _) in enumerate(steps) if running and not ran]
    assert all(steps[k + 1][2] for k in skipped if k + 1 < len(steps)), steps


class _TwoPolls:
    """The decode side's transport, its notifications out of the second ``poll_notifs`` after they
    arrived, as a NIXL write's are (the first poll completes the write, the second brings the
    notification its writer sends then). ``arrived`` maps a notification to the poll count at
    which it first came in."""

    def __init__(self, inner) -> None:
        self.inner, self.acked, self.polls, self.arrived = inner, [], 0, {}

    def poll_notifs(self):
        self.polls += 1
        out, self.acked = self.acked, self.inner.poll_notifs()
        for _, raw in self.acked:
            self.arrived[raw] = self.polls
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_write_lands_in_the_decode_step_whose_forward_it_came_during(tiny):
    """A decode step polls the transport on each side of its forward, so a notification that needs
    two polls lands in the step that first saw the write, not the next one."""
    from bench.harness.pd_harness import PDHarness
    from configs.schema import PdserveConfig
    from transfer.wire.sampling_params import SamplingParams

    cfg = PdserveConfig.model_validate(
        {"engine": {"kv_pool_tokens": 1024, "page_size": 4}, "cluster": {"mode": "pd", "transfer_backend": "loopback"}}
    )
    h = PDHarness(cfg, cfg, tiny[0], tiny[1])
    try:
        t = h.decode.transfers.transport = _TwoPolls(h.decode.transfers.transport)
        h.submit("a", list(range(1, 13)), SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True))
        while not h.decode.running:
            h.step()
        h.submit("b", list(range(20, 32)), SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))
        first_at = None
        while first_at is None:
            polls = t.polls
            if any(d.rid == "b" and d.token_ids for d in h.step()):
                first_at = polls
        (arrived,) = [n for raw, n in t.arrived.items() if b'"rid":"b"' in raw]
        assert arrived == first_at + 1 and t.polls == first_at + 2  # seen and landed in the same decode turn
        while h.busy:
            h.step()
        h.check_clean()
    finally:
        h.close()
