"""Re-planning while the device is idle (DESIGN §7).

A `Replanner` attaches a StatsRecorder to the engine (starting from what earlier
sessions saved for this model), gives the `moepic` policy the configurator's plan,
and, when called between chat turns or after a bench run (`on_idle`), saves the
statistics and — once τ tokens have passed since the last plan — re-plans and
rebuilds the cache: `engine.configure(settings, warm=True)` keeps the policies'
history and fills each layer with its top-C_i experts by LCP priority, split at θ_i.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from fmoe_cli.offload.engine import Engine, EngineSettings
from fmoe_cli.planning.autoplan import engine_timings, moepic_plan
from fmoe_cli.planning.configurator import DEFAULT_TAU, Timings, replan_due
from fmoe_cli.types import Plan
from fmoe_cli.planning.stats import StatsRecorder, default_stats_path, open_recorder


class Replanner:
    def __init__(self, engine: Engine, budget_bytes: int, timings: Timings | Callable[[], Timings],
                 recorder: StatsRecorder, tau: int = DEFAULT_TAU, model: str = "") -> None:
        self.engine = engine
        self.budget_bytes = budget_bytes
        self._timings = timings  # Timings, or how to find them when first needed
        self.recorder = recorder
        self.tau = tau  # τ: tokens between re-plans
        self.model = model
        self.tokens_at_plan = recorder.tokens
        self.replans = 0

    @classmethod
    def attach(cls, lm, engine: Engine, budget_bytes: int, *, timings: Timings | None = None,
               stats_path: Path | None = None, tau: int = DEFAULT_TAU, profile_path: Path | None = None) -> Replanner:
        """Load this model's saved statistics and observe the engine. Timings, if not given, are found
        when the first plan is made (see engine_timings): a session without `moepic` never measures."""
        shape = lm.shape
        path = stats_path or default_stats_path(lm.model_id, model_path=lm.path)
        recorder = open_recorder(lm.model_id, shape.num_layers, shape.num_experts, shape.top_k, path)
        engine.observers.append(recorder)
        return cls(engine, budget_bytes, timings or (lambda: engine_timings(lm, engine, profile_path)), recorder, tau,
                   lm.model_id)

    @property
    def timings(self) -> Timings:
        """The configurator's timings. A quick measurement reconfigures the engine: it is put back to
        its settings (cold: call this before generating, as `settings()` is)."""
        if callable(self._timings):
            before = self.engine.settings
            self._timings = self._timings()
            if before is not None and self.engine.settings is not before:
                self.engine.configure(before)
        return self._timings

    @property
    def stats(self):
        return self.recorder.stats

    def plan(self, prefetch_width: int | None = None) -> Plan:
        """The configurator's plan from the statistics so far."""
        return moepic_plan(self.engine.shape, self.budget_bytes, self.timings, self.stats,
                           prefetch_width=prefetch_width, model=self.model)

    def settings(self, settings: EngineSettings) -> EngineSettings:
        """`moepic` with the configurator's plan; other policies unchanged."""
        if settings.policy != "moepic":
            return settings
        self.tokens_at_plan = self.recorder.tokens
        return replace(settings, plan=self.plan(settings.prefetch_width))

    def due(self) -> bool:
        return replan_due(self.recorder.tokens - self.tokens_at_plan, device_idle=True, tau=self.tau)

    def on_idle(self) -> bool:
        """The device is idle: save the statistics; re-plan and rebuild the cache if τ tokens have passed.

        Returns whether it re-planned."""
        self.recorder.save()
        current = self.engine.settings
        if current is None or current.policy != "moepic" or not self.due():
            return False
        self.engine.configure(self.settings(current), warm=True)
        self.replans += 1
        return True

    __call__ = on_idle  # a Replanner is an idle hook (bench.run.IdleHook)

    def close(self) -> None:
        self.recorder.save()
        if self.recorder in self.engine.observers:
            self.engine.observers.remove(self.recorder)


def attach_replanner(lm, engine: Engine, budget_bytes: int, profile_path: Path | None = None) -> Replanner:
    """The idle-hook factory of `fmoe chat` and `fmoe bench` (bench.run.IdleFactory): record
    statistics, and if the engine already runs `moepic`, give it the configured plan now.
    `profile_path` (chat --profile): the profile to take timings from instead of the default one."""
    planner = Replanner.attach(lm, engine, budget_bytes, profile_path=profile_path)
    if engine.settings is not None and engine.settings.policy == "moepic":
        engine.configure(planner.settings(engine.settings))
    return planner
