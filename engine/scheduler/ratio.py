"""new_token_ratio: how much of each running request's remaining ``max_new_tokens`` admission
reserves. High when idle (conservative), decays while decoding, reset from reality after a retract.
"""

from __future__ import annotations

from configs.scheduler import SchedulerConfig


class NewTokenRatioTracker:
    """Ratio in ``[floor, 1]``; ``floor = init * min_new_token_ratio_factor``.

    ``step()`` decays linearly from ``init`` to ``floor`` over ``new_token_ratio_decay_steps``
    decode steps; ``reset_after_retract`` sets it to
    ``(decoded + retract_decode_steps * n_reqs) / (max_new_total + 1)`` clamped to ``[floor, 1]``.
    """

    def __init__(self, cfg: SchedulerConfig) -> None:
        self.init = min(1.0, cfg.init_new_token_ratio * cfg.schedule_conservativeness)
        self.floor = self.init * cfg.min_new_token_ratio_factor
        self.decay = (self.init - self.floor) / cfg.new_token_ratio_decay_steps
        self.retract_steps = cfg.retract_decode_steps
        self.value = self.init

    def step(self) -> None:
        self.value = max(self.floor, self.value - self.decay)

    def idle(self) -> None:
        """Nothing is running: go back to the conservative start value."""
        self.value = self.init

    def reset_after_retract(self, decoded_tokens: int, num_reqs: int, max_new_total: int) -> float:
        estimate = (decoded_tokens + self.retract_steps * num_reqs) / (max_new_total + 1)
        self.value = min(1.0, max(self.floor, estimate))
        return self.value
