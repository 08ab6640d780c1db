"""A verify step runs as a decode step: each drafting row's ``[last token, d1 .. dK]`` becomes K + 1
one-token decode rows at their positions, so the C decode stack takes the whole batch (plain rows
too) instead of every row leaving it for the per-layer extend path. That the outputs stay those of
decoding without speculation is ``test_spec_identity``'s."""

from __future__ import annotations

from engine.forward_batch import ForwardMode
from tests.engine.test_spec_identity import greedy, make, repeating_prompts, run
from tests.support.cpu_kernels import needs_small_batch_kernels


@needs_small_batch_kernels
def test_drafting_steps_run_on_the_decode_stack(tiny):
    jobs = [(p, greedy(32)) for p in repeating_prompts(3)]
    # every forward recorded: (mode, longest row, drafts given, stack ran); outputs: test_spec_identity
    sched = make(tiny, True, mixed_batches=False)
    stack = sched.runner.model.stack
    assert stack is not None, "the tiny model should take the decode stack"
    steps, last = [], {}
    drafts, forward, stack_run = sched.spec.drafts, sched.runner.forward, stack.run

    def recording_drafts(reqs, other):
        ds = drafts(reqs, other)
        last["drafted"] = sum(len(d) for d in ds)
        return ds

    def recording_forward(mode, seqs, num_decode=0):
        last["stack"] = False
        out = forward(mode, seqs, num_decode)
        steps.append((mode, max(len(s.token_ids) for s in seqs), last.pop("drafted", 0), last["stack"]))
        return out

    def recording_run(h, batch, attn):
        last["stack"] = True
        return stack_run(h, batch, attn)

    sched.spec.drafts, sched.runner.forward, stack.run = recording_drafts, recording_forward, recording_run
    run(sched, jobs)
    verify = [s for s in steps if s[2]]
    assert len(verify) >= 5 and sched.spec.accepted_tokens >= 10
    assert all(mode is ForwardMode.DECODE and width == 1 and on_stack for mode, width, _, on_stack in verify), verify
