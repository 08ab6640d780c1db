"""One output choice: a session's deltas turned into text pieces, with stop strings applied.

``ChoiceRun.step()`` returns the next ``Piece`` (text released so far, the token ids and logprobs
that came with it, and the finish reason on the last one). When a stop string matches, the piece
is cut before it, its finish reason is "stop", and the session is closed (which aborts the
request in the worker). A stop token the worker ended on (``TokenDelta.stop_token_id``: EOS or a
``stop_token_ids`` id) is a generated token of the choice (ids, logprobs, usage), as in vLLM, but
its text is not part of the output unless ``include_stop``. ``merge()`` interleaves the pieces of
several choices for streaming.

A run that ``follows`` another (a later choice of the same prompt, ``n`` > 1) is not sent by the
caller: its first ``step()`` waits until the leader has its first piece (or has failed), then sends
its session on the leader's route, so the prompt the leader's workers just cached is reused; on a
fresh route when a worker of the leader's left rotation or switched role meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

from engine.tokenizer import Tokenizer
from server.router.detok import TextStream
from server.router.errors import APIError
from server.router.session import GenerationSession


@dataclass
class Piece:
    """Text and tokens released by one step of a choice; ``finish_reason`` set on the last one."""

    text: str
    ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    finish_reason: str | None = None


class ChoiceRun:
    """Drive ``session`` to the end, accumulating the choice's tokens, logprobs and text."""

    def __init__(
        self,
        index: int,
        session: GenerationSession,
        tokenizer: Tokenizer,
        stop: Iterable[str] = (),
        skip_special_tokens: bool = True,
        prompt_text: str | None = None,
        include_stop: bool = False,
        follows: ChoiceRun | None = None,
        keep_output: bool = True,
    ) -> None:
        self.index = index
        self.follows = follows
        self.keep_output = keep_output  # False: echo with max_tokens 0, the one token generated is dropped
        self._prompt_logprobs = None
        self.leader = follows  # kept after the follower is sent
        self.leads = follows is None  # the prompt's first choice: its prompt counts once in usage
        self.started = asyncio.Event()  # set once this run's first piece came (or its first step failed)
        self.started_ok = False
        self.session = session
        self.prompt_text = prompt_text
        self.include_stop = include_stop
        self.stream = TextStream(tokenizer, stop, skip_special_tokens, include_stop)
        self.token_ids: list[int] = []
        self.logprobs: list[float | None] = []
        self.top_logprobs: list[list[tuple[int, float]] | None] = []
        self.finish_reason: str | None = None
        self.cached_tokens = 0

    @property
    def done(self) -> bool:
        """True once the choice has its finish reason."""
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """The choice's text so far (final once ``done``)."""
        return self.stream.text

    async def step(self) -> Piece:
        """The next piece; raises ``APIError`` from the session. Do not call once ``done``."""
        try:
            if self.follows is not None:
                await self._send_after_leader()
            piece = self._piece(await self.session.next())
            self.started_ok = True
            return piece
        finally:
            self.started.set()

    async def _send_after_leader(self) -> None:
        """Send this run's session (prepared on the leader's route) once the leader has its first
        piece; 503 ``APIError`` without sending when the leader failed first."""
        leader, self.follows = self.follows, None
        await leader.started.wait()
        if not leader.started_ok or self.session.closed:
            raise APIError(
                503,
                "not sent: the first choice of this prompt failed before its first token",
                code="worker_unavailable",
            )
        if not self.session.route_current():  # a worker of the leader's route left or switched role
            self.session.prepare()
        self.session.send()

    @property
    def prompt_logprobs(self):
        """The prompt's ``PromptLogprobs`` (from the first delta; a follower has its leader's), or None."""
        if self._prompt_logprobs is None and self.leader is not None:
            return self.leader.prompt_logprobs
        return self._prompt_logprobs

    def _piece(self, delta) -> Piece:
        if delta.prompt_logprobs is not None:
            self._prompt_logprobs = delta.prompt_logprobs
        if not self.keep_output:
            self.finish_reason = "length"
            self.session.close("echo with max_tokens 0: only the prompt was asked for")
            return Piece("", finish_reason="length")
        text = self.stream.push(delta.token_ids)
        ids, logprobs, tops = delta.token_ids, delta.logprobs, delta.top_logprobs
        if delta.stop_token_id is not None:
            ids, logprobs, tops = (
                ids + [delta.stop_token_id],
                logprobs + [delta.stop_logprob],
                tops + [delta.stop_top_logprobs],
            )
            if self.include_stop:
                text += self.stream.push([delta.stop_token_id])
        self.token_ids += ids
        self.logprobs += logprobs
        self.top_logprobs += tops
        self.cached_tokens = max(self.cached_tokens, delta.cached_tokens)
        finish = delta.finish_reason
        if self.stream.stopped:
            finish = "stop"
            self.session.close("stop string matched")
        elif finish:
            text += self.stream.finish()
        self.finish_reason = finish
        return Piece(text, ids, logprobs, tops, finish)

    async def collect(self) -> None:
        """Run to the end (non-streaming)."""
        while not self.done:
            await self.step()


async def merge(runs: list[ChoiceRun]) -> AsyncIterator[tuple[ChoiceRun, Piece]]:
    """Pieces of every unfinished run as they come, until all are done.

    The first ``APIError`` of any run is raised here; pending steps are cancelled on exit.
    """
    pending = {asyncio.ensure_future(r.step()): r for r in runs if not r.done}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                run = pending.pop(fut)
                piece = fut.result()
                yield run, piece
                if not run.done:
                    pending[asyncio.ensure_future(run.step())] = run
    finally:
        for fut in pending:
            fut.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
