"""A decode worker's turn order: what it has to send (a landed request's first token, KV
destinations, migration offers) leaves before the step's forward, and the decode runs the next
turn (``DecodeScheduler.step``), never two turns in a row without it while requests run."""
from __future__ import annotations


def test_decode_worker_answers_the_first_token_before_its_next_decode_step(tiny):
    """The landing turn sends the manifest's first token alone; the decode step (token 2) is the
    next turn's, so PD's time to first token never includes a decode step."""
    from server.testing.pd_harness import PDHarness
    from configs.schema import PdserveConfig
    from transfer.wire.sampling_params import SamplingParams

    cfg = PdserveConfig.model_validate({"engine": {"kv_pool_tokens": 1024, "page_size": 4},
                                        "cluster": {"mode": "pd", "transfer_backend": "loopback"}})
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
    from server.testing.pd_harness import PDHarness
    from configs.schema import PdserveConfig
    from transfer.wire.protocol import KVDestination
    from transfer.wire.sampling_params import SamplingParams

    cfg = PdserveConfig.model_validate({"engine": {"kv_pool_tokens": 1024, "page_size": 4},
                                        "cluster": {"mode": "pd", "transfer_backend": "loopback"}})
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
