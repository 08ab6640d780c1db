"""The string enums the wire, metrics labels and JSON carry: their values are the strings they
always were (``StrEnum``: a member equals, hashes and formats as its value)."""

from __future__ import annotations

import enum


class Role(enum.StrEnum):
    """What a process of a deployment does (``WorkerStats.role``, ``--role``, metrics labels)."""

    COLOCATED = "colocated"  # a worker that prefills and decodes
    PREFILL = "prefill"  # PD: computes prompts' KV and ships it to a decode worker
    DECODE = "decode"  # PD: receives KV and decodes
    ROUTER = "router"  # the HTTP front end (a launch role, not a worker)


ALL_WORKER_ROLES: tuple[Role, ...] = (Role.COLOCATED, Role.PREFILL, Role.DECODE)


class FinishReason(enum.StrEnum):
    """Why a request ended (``TokenDelta.finish_reason``, the OpenAI ``finish_reason``)."""

    STOP = "stop"  # an EOS or stop token
    LENGTH = "length"  # max_new_tokens, or the model's context
    ABORT = "abort"  # aborted or failed: the delta carries the error

    @property
    def completed(self) -> bool:
        """The request ran to its end (its KV may go to the radix cache)."""
        return self is not FinishReason.ABORT
