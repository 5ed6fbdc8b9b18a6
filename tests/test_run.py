"""One run set-up (fmoe_cli/run.py): `moepic` is planned before the engine is first configured,
and the engine of `fmoe chat` / `fmoe bench` is configured once at the start."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from fmoe_cli.cli import app
from fmoe_cli.offload.engine import Engine
from fmoe_cli.planning.presets import PRESETS


@pytest.fixture
def configures(monkeypatch):
    """Every Engine.configure: (engine, policy, plan source, warm), and forwards seen before each."""
    calls: list[tuple[int, str, str, bool]] = []
    real = Engine.configure

    def configure(self, settings, warm=False):
        calls.append((id(self), settings.policy, settings.plan.source, warm))
        return real(self, settings, warm)

    monkeypatch.setattr(Engine, "configure", configure)
    return calls


def of_engine(calls, policy: str) -> list[tuple[str, str, bool]]:
    """The configures of the engine that served `policy` (the run's engine, not a measuring one)."""
    engine = next(e for e, p, _, _ in calls if p == policy)
    return [(p, source, warm) for e, p, source, warm in calls if e == engine]


def test_chat_configures_the_engine_once_with_the_configured_plan(checkpoints, configures, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))  # no saved profile: timings measured
    result = CliRunner().invoke(app, ["chat", str(checkpoints["mixtral"]), "--device", "cpu",
                                      "--emulate-link", "20"], input="/exit\n")
    assert result.exit_code == 0, result.output
    assert of_engine(configures, "moepic") == [("moepic", "configurator", False)]
    # The timings were measured on a temporary engine of their own, never on the run's.
    assert {p for _, p, _, _ in configures} == {"moepic", "ondemand"}


def test_bench_configures_once_per_policy(checkpoints, configures, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    result = CliRunner().invoke(app, ["bench", str(checkpoints["mixtral"]), "--policy", "moepic", "--policy", "lru",
                                      "--tokens", "2", "--warmup", "1", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    cold = [(p, source) for p, source, warm in of_engine(configures, "moepic") if not warm]
    assert cold == [("moepic", "configurator"), ("lru", "lru")]
    runs = {r["policy"]: r for r in json.loads(result.stdout)["runs"]}
    assert runs["moepic"]["plan"].startswith("configurator:")


def test_no_behaviour_keyed_on_a_policy_name():
    """Behaviour is the preset table's: no module compares with a policy's name."""
    import re
    from pathlib import Path

    import fmoe_cli

    names = "|".join(re.escape(name) for name in PRESETS)
    compare = re.compile(rf'(==|!=|\bin)\s*\(?"({names})"|"({names})"\s*(==|!=)')
    root = Path(fmoe_cli.__file__).parent
    offenders = [f"{path.relative_to(root)}:{n}: {line.strip()}" for path in sorted(root.rglob("*.py"))
                 for n, line in enumerate(path.read_text().splitlines(), 1) if compare.search(line)]
    assert offenders == []


def test_context_sizes_the_kv_reserve_and_the_run_keeps_it(checkpoints, monkeypatch):
    """--context N: the device room left for experts is computed with the KV cache of N tokens' static cache, N
    rounded up to the DecodeGraph's 256 positions (and the run carries N for chat's window); by default the model's
    own 512 tokens here (below 8192)."""
    import fmoe_cli.run as run_module
    from fmoe_cli.planning.plan import kv_cache_bytes
    from fmoe_cli.run import RunOptions, open_run

    asked = []
    real = run_module.device_room
    monkeypatch.setattr(run_module, "device_room", lambda device, kv, **kw: asked.append(kv) or real(device, kv, **kw))
    for context, want, capacity in ((100, 100, 256), (200, 200, 256), (None, 512, 512)):
        asked.clear()
        with open_run(RunOptions(model=str(checkpoints["mixtral"]), device="cpu", context=context,
                                 record_statistics=False)) as run:
            assert run.context == want
            assert asked[-1] == kv_cache_bytes(run.lm.model.config, capacity, run.lm.shape.dtype_bytes) > 0


def test_host_threads_reach_the_engines_host_lane(checkpoints):
    """--host-threads N: the run's engine computes its host lane on N threads (1 by default)."""
    from fmoe_cli.run import RunOptions, open_run

    for threads in (1, 3):
        with open_run(RunOptions(model=str(checkpoints["mixtral"]), device="cpu", host_threads=threads,
                                 record_statistics=False)) as run:
            assert run.engine.host_lane.threads == threads
