"""Run each step the C decode stack takes on both paths, for tests that compare them."""

from __future__ import annotations


class BothPaths:
    """Wraps a model's forward: each step runs the stack path, then (the KV pools restored) the
    layer path on the same batch. Steps the stack takes are recorded in ``steps`` as
    (rows, stack logits, layer logits, pools after the stack, pools after the layers; the full and
    SWA pools' one allocation); the model's result is the stack's."""

    def __init__(self, model) -> None:
        self.model, self.forward, self.stack, self.steps = model, model.forward, model.stack, []
        model.forward = self

    def __call__(self, batch, attn):
        pool = attn.pools.units
        before, took = pool.clone(), self.stack.takes(batch, attn)
        a = self.forward(batch, attn)
        stored = pool.clone()
        pool.copy_(before)
        self.model.stack = None
        try:
            b = self.forward(batch, attn)
        finally:
            self.model.stack = self.stack
        if took:
            self.steps.append((batch.batch_size, a, b, stored, pool.clone()))
        return a
