"""Re-planning while the device is idle (docs/architecture.md, "re-planning").

A `Replanner` holds the StatsRecorder that observes the engine (statistics start from
what earlier sessions saved for this model) and the plan inputs the run was set up
with. Called between chat turns or after a bench run (`on_idle`), it saves the
statistics and — when the engine runs a preset whose plan reads them
(`Preset.configured`) and τ tokens have passed since that plan was made — makes the
plan again from the statistics so far and rebuilds the cache:
`engine.configure(settings, warm=True)` keeps the policies' history and fills each
layer with its top-C_i experts by priority, split at θ_i. It never measures anything
and never runs while the device is busy.

A plan made without any recorded routing (a model's first session: uniform routing
assumed) is made again as soon as FIRST_PLAN_TOKENS tokens have been recorded, not τ:
`fmoe bench` re-plans after its warm-up, `fmoe chat` after the first answer. (Ours, not
MoEpic's: its τ = 5,000 assumes statistics to start from.) So is a plan made before MIN_PREDICTIONS
decode tokens had a recorded prediction: the configurator then keeps prefetch (it cannot yet judge
the predictor, planning/configurator.py), and plans again once it can.
"""

from __future__ import annotations

from dataclasses import replace

from fmoe_cli.offload.engine import Engine
from fmoe_cli.planning.configurator import DEFAULT_TAU, replan_due
from fmoe_cli.planning.plan import MIN_PREDICTIONS
from fmoe_cli.planning.presets import PRESETS, PlanInputs, settings_for
from fmoe_cli.planning.stats import StatsRecorder

FIRST_PLAN_TOKENS = 32  # a plan made without recorded routing is made again after this many tokens


class Replanner:
    def __init__(self, engine: Engine, inputs: PlanInputs, recorder: StatsRecorder, tau: int = DEFAULT_TAU) -> None:
        self.engine = engine
        self.inputs = inputs  # shape, budget, timings, model (statistics: the recorder's)
        self.recorder = recorder
        self.tau = tau  # τ: tokens between re-plans
        self.tokens_at_plan = recorder.tokens
        self.blind = self._blind()  # the plans so far were made without recorded routing or predictions
        self.replans = 0
        if recorder not in engine.observers:
            engine.observers.append(recorder)

    @property
    def stats(self):
        return self.recorder.stats

    def plan_inputs(self) -> PlanInputs:
        """The run's plan inputs with the statistics so far; a plan made from them counts as the latest."""
        self.tokens_at_plan = self.recorder.tokens
        self.blind = self._blind()
        return replace(self.inputs, stats=self.stats)

    def _blind(self) -> bool:
        return self.recorder.tokens == 0 or self.stats.predicted_tokens < MIN_PREDICTIONS

    def due(self) -> bool:
        since = self.recorder.tokens - self.tokens_at_plan
        return replan_due(since, device_idle=True, tau=min(FIRST_PLAN_TOKENS, self.tau) if self.blind else self.tau)

    def on_idle(self) -> bool:
        """The device is idle: save the statistics; re-plan and rebuild the cache if τ tokens have passed.

        Returns whether it re-planned."""
        self.recorder.save()
        current = self.engine.settings
        if current is None or not PRESETS[current.policy].configured or not self.due():
            return False
        # The preset's settings again (its plan may also turn prefetch on or off), same ω and ρ.
        self.engine.configure(settings_for(current.policy, self.plan_inputs(), omega=current.omega, rho=current.rho),
                              warm=True)
        self.replans += 1
        return True

    __call__ = on_idle  # a Replanner is the run's idle hook

    def close(self) -> None:
        self.recorder.save()
        if self.recorder in self.engine.observers:
            self.engine.observers.remove(self.recorder)
