"""A stand-in for ``ModelRunner`` in core lending's tests (``server.worker.main.core_lending``)."""

from __future__ import annotations

import torch


class FakeRunner:
    """What ``core_lending`` reads of a runner: its device, step matmul timings (``seconds`` per
    thread count; each call recorded in ``asked``) and their key, and the warm-up (``warmed``)."""

    def __init__(self, seconds: dict[int, float]) -> None:
        self.device, self.seconds, self.asked, self.warmed = torch.device("cpu"), seconds, [], None

    def matmul_seconds(self, threads: int, rows: int, repeats: int) -> float:
        self.asked.append((threads, rows))
        return self.seconds[threads]

    def matmul_fingerprint(self) -> str:
        return "the-model"

    def warm_up_threads(self, counts) -> None:
        self.warmed = tuple(counts)
