"""The router's periodic SLO planner (``--planner slo``): evaluate, log, switch.

Every ``planner_interval_s`` the ``Planner`` builds a ``ClusterView`` from the workers' heartbeats
(``server.router.planner_view``), asks ``server.router.planner.decide`` and logs the decision with
its inputs (INFO when a violation is seen or a move made, DEBUG otherwise). A move goes through the
same path as ``POST /admin/role`` (``server.router.roles.switch_role``: the same checks, a role is
never left empty) and, once done, counts in ``pdserve_role_switches_total{from,to,reason="planner"}``.
A refused or failed switch is logged; the dwell still starts (no retry storm). One evaluation at a
time: the next starts after the previous one (and its switch) ended.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from configs.server import ServerConfig
from server.router.metrics import RouterMetrics
from server.router.planner import Decision, Knobs, PlannerState, decide
from server.router.planner_view import ViewBuilder
from server.router.registry import Registry
from server.router.roles import SwitchRefused, switch_role

log = logging.getLogger(__name__)


def knobs_of(cfg: ServerConfig) -> Knobs:
    """The planner's knobs from the router's config (milliseconds to seconds); ``planner_cores``
    ``auto`` that no launch resolved (workers started elsewhere) counts as ``own``; the horizon of a
    growing wait for decode pages is the planner's reaction time (hysteresis x interval)."""
    return Knobs(
        slo_ttft_s=cfg.slo_ttft_ms / 1000.0,
        slo_tpot_s=cfg.slo_tpot_ms / 1000.0,
        hysteresis=cfg.planner_hysteresis,
        dwell_s=cfg.planner_dwell_s,
        headroom=cfg.planner_headroom,
        shared_cores=cfg.planner_cores == "shared",
        horizon_s=cfg.planner_hysteresis * cfg.planner_interval_s,
    )


def views_of(cfg: ServerConfig) -> ViewBuilder:
    """The planner's view builder for the router's config: a decode step time is taken between two
    evaluations' heartbeats at most two evaluation periods and two heartbeats apart (one period
    apart, each heartbeat up to one period late, and a missed evaluation's slack); a longer gap is
    time the router did not see the worker through."""
    return ViewBuilder(max_step_gap_s=2 * (cfg.planner_interval_s + cfg.health_interval_s))


def queue_wait_of(metrics: RouterMetrics) -> tuple[float, float]:
    """(sum, count) of the router's admission queue wait histogram."""
    total = count = 0.0
    for fam in metrics.queue_wait.collect():
        for sample in fam.samples:
            if sample.name.endswith("_sum"):
                total = sample.value
            elif sample.name.endswith("_count"):
                count = sample.value
    return total, count


class Planner:
    """Evaluates ``decide`` over ``registry``'s workers and makes its moves (module docstring)."""

    def __init__(
        self,
        registry: Registry,
        metrics: RouterMetrics,
        knobs: Knobs,
        switch_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        views: ViewBuilder | None = None,
    ) -> None:
        """``switch_timeout_s``: as ``switch_role`` takes it (for the worker to empty itself and answer);
        ``views``: the view builder (``views_of`` the router's config; its defaults when None)."""
        self.registry, self.metrics, self.knobs = registry, metrics, knobs
        self.switch_timeout_s, self.clock = switch_timeout_s, clock
        self.state = PlannerState()
        self.views = views or ViewBuilder()

    async def evaluate(self) -> Decision:
        """One evaluation: decide, log, and make the move if there is one."""
        waited = self.registry.table.oldest_first_token_wait(time.monotonic())
        view = self.views.build(self.registry.handles.values(), queue_wait_of(self.metrics), self.clock(), waited)
        decision = decide(view, self.state, self.knobs)
        self.state = decision.state
        level = (
            logging.INFO if decision.move or decision.state.ttft_streak or decision.state.tpot_streak else logging.DEBUG
        )
        log.log(
            level,
            "planner: %s | predicted TTFT %s, TPOT %s, after move %s | queue wait %.3f s, longest wait for a "
            "first token %.3f s, prompt %.0f "
            "tokens, workers (id, role, backlog, prefill tok/s, batch, step s, awaiting KV, waiting for pages, "
            "own prefill tok/s, own prefill backlog) %s",
            decision.why,
            _s(decision.ttft_s),
            _s(decision.tpot_s),
            _s(decision.after_s),
            view.queue_wait_s,
            view.first_token_wait_s,
            view.prompt_tokens,
            [
                (
                    w.worker_id,
                    str(w.role),
                    w.backlog_tokens,
                    w.prefill_tps,
                    w.batch,
                    w.step_s,
                    w.awaiting,
                    w.page_waiting,
                    w.local_tps,
                    w.local_backlog,
                )
                for w in view.workers
            ],
        )
        if decision.move is not None:
            await self._switch(*decision.move)
        return decision

    async def _switch(self, worker_id: str, old, new) -> None:
        """Switch ``worker_id`` through the admin path; count it with reason ``planner``."""
        try:
            done = await switch_role(self.registry, worker_id, new, self.switch_timeout_s)
        except SwitchRefused as e:
            log.warning("planner: switch of %s %s -> %s not made: %s", worker_id, old, new, e)
            return
        self.metrics.observe_role_switch(done.old, done.new, "planner")
        log.warning("planner: %s switched %s -> %s in %.3f s", worker_id, done.old, done.new, done.seconds)

    async def run(self, interval_s: float) -> None:
        """Evaluate every ``interval_s`` until cancelled; an unexpected error is logged, not fatal."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.evaluate()
            except Exception:  # noqa: BLE001 - the planner must not take the router down
                log.exception("planner: evaluation failed")


def _s(v: float | None) -> str:
    return "unknown" if v is None else f"{v:.3f} s"
