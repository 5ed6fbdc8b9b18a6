"""Host work per MoE layer on the GPU's per-step path, measured on the CPU (issue 37 §2).

No GPU in CI and rarely one at hand, so what a GPU's decode step costs the host is measured here, on a model whose
compute is near nothing: a tiny 3-layer Mixtral (hidden 128, 8 experts of 256 neurons, top-2), a 40 % expert budget,
an emulated 100 GB/s link, torch's matmuls (FMOE_KERNELS=torch: no C kernels, no one-call token), `resident`, `lru`
and `moepic`, 48 tokens, 3 rounds interleaved in each process. Each figure is TPOT ÷ 3 layers: what a token costs
the host per layer, since the compute is microseconds. On the first H200 the same checkpoint took 1.43 (resident) and
1.74 (lru) ms a layer, close to what this measure read then (1.51 / 1.61).

Two paths of this checkout, processes alternating (`--processes` each):
- `cpu`: the engine as it runs on the CPU;
- `device`: FMOE_DEVICE_PATH=1, the engine's device path (a GPU's: resident layers routed on the device and their
  bookkeeping deferred, the routing read through `link.read_to_host`).
`--trees DIR ...` runs other source trees (a `git worktree` of an older commit) the same way, for a before/after.

Then what a step replayed from CUDA graph segments would leave to the host (`eager_part`): on a GPU the attention,
norms, routers and head run as graph segments between the layers whose routing the host reads, so a loading policy's
host work a layer is its experts forward there; timed in-process on the process's CPU clock (a forecast, not a GPU's
figure). Then the host's waits for the device, counted (not timed) over three decode steps of each policy on the device path
(profiling/ops.py `count_host_waits`): per MoE layer, and outside the experts.

    python benchmarks/host_per_layer.py [--processes 2] [--trees OLD_TREE]

On a machine others are using, FMOE_EMULATED_CLOCK=cpu (passed on to every process) reads each token's latency as the
process's CPU time: wall time then counts the waits for a core.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
POLICIES = ("resident", "lru", "moepic")
LAYERS = 3


def checkpoint(path: Path) -> Path:
    from fmoe_cli.models.demo import build_random_moe

    if not (path / "config.json").exists():
        build_random_moe(path, family="mixtral", seed=7, num_hidden_layers=LAYERS, hidden_size=128,
                         intermediate_size=256)
    return path


def bench(tree: Path, model: Path, device_path: bool, tokens: int, rounds: int) -> dict:
    # one torch thread: the host work of one thread, as a GPU's host thread does it (not the wake-ups of an OpenMP team,
    # which doubled single readings whenever the other core was busy)
    env = dict(os.environ, FMOE_KERNELS="torch", PYTHONPATH=str(tree), FMOE_DEVICE_PATH="1" if device_path else "0",
               OMP_NUM_THREADS="1")
    policies = [a for p in POLICIES for a in ("--policy", p)]
    done = subprocess.run([sys.executable, "-m", "fmoe_cli.cli", "bench", str(model), *policies, "--vram-budget", "40%",
                           "--emulate-link", "100", "--tokens", str(tokens), "--rounds", str(rounds), "--json"],
                          capture_output=True, text=True, env=env, cwd=tree, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"error: fmoe bench failed in {tree}: {done.stderr.strip().splitlines()[-1:]}")
    report = json.loads(done.stdout[done.stdout.find("{"):])
    return {r["policy"]: r["tpot_ms"]["median"] / LAYERS for r in report["runs"]}


def device_path_engine(model: Path, policy: str):
    """The model at `model` and an engine on the device path (FMOE_KERNELS=torch: torch's matmuls) over an instant
    emulated link, planned for `policy` at a 40 % budget from fixed timings -> (model, engine)."""
    os.environ["FMOE_KERNELS"] = "torch"
    from fmoe_cli.models.load import load_model
    from fmoe_cli.offload.engine import Engine
    from fmoe_cli.offload.link import EmulatedLink
    from fmoe_cli.planning.presets import make_settings
    from fmoe_cli.types import Timings

    lm = load_model(str(model), device="cpu", dtype="float32")
    shape = lm.shape
    engine = Engine(lm.layers, lm.store, shape, EmulatedLink(None), lm.device, lm.dtype)
    engine.device_side = True
    engine.install(lm.model)
    timings = Timings(t_att=1e-4, t_moe=2e-4, t_head=1e-4, t_load=3e-4, top_k=shape.top_k)
    engine.configure(make_settings(policy, shape, int(0.4 * shape.all_experts_bytes), timings=timings))
    return lm, engine


def waits(model: Path) -> dict:
    """Host waits per MoE layer over three decode steps of each policy on the device path, and outside the experts."""
    os.environ["FMOE_KERNELS"] = "torch"
    import torch

    from fmoe_cli.generate import stream_generate
    from fmoe_cli.profiling.ops import count_host_waits

    out = {}
    for policy in POLICIES:
        lm, engine = device_path_engine(model, policy)
        steps = stream_generate(lm.model, torch.tensor([list(range(5, 40))]), engine=engine, max_new_tokens=8,
                                stop_on_eos=False)
        for _ in range(5):
            next(steps)
        counts = count_host_waits(lambda: [next(steps) for _ in range(3)], engine, lm.model)
        engine.close()
        layers = counts["moe_layers"]
        out[policy] = {"per_moe_layer": counts["waits"].get("moe", 0) / layers,
                       "outside_per_token": (counts["waits"].get("other", 0) + counts["waits"].get("settle", 0)) / 3,
                       "where": counts["where"]}
    return out


def eager_part(model: Path, tokens: int, rounds: int) -> dict:
    """What a decode step replayed from CUDA graph segments leaves to the host, per MoE layer (the loading policies):
    the engine's experts forward of a layer whose routing the host reads (the routing read, the classification, the
    loads, the experts on what is on the device, the weighted sum), timed on the process's CPU clock on the device
    path, in-process, `rounds` runs of `tokens` decode tokens each after 8 unmeasured ones (median over the runs). On
    a GPU the rest of the step (attention, norms, router, head) is replayed from the graph segments between those
    forwards; resident is one graph, with none. A forecast from the CPU, not a GPU's figure."""
    os.environ["FMOE_KERNELS"] = "torch"
    import time

    import torch

    from fmoe_cli.generate import stream_generate
    from fmoe_cli.offload.engine import Engine

    torch.set_num_threads(1)
    spent = [0.0, 0]  # CPU seconds inside the experts forward, its calls
    real = Engine.experts_forward

    def timed(self, *args, **kwargs):
        start = time.process_time()
        try:
            return real(self, *args, **kwargs)
        finally:
            spent[0] += time.process_time() - start
            spent[1] += 1

    out = {}
    Engine.experts_forward = timed
    try:
        for policy in POLICIES[1:]:
            lm, engine = device_path_engine(model, policy)
            per_layer, per_token = [], []
            for _ in range(rounds):
                steps = stream_generate(lm.model, torch.tensor([list(range(5, 40))]), engine=engine,
                                        max_new_tokens=tokens + 8, stop_on_eos=False)
                for _ in range(8):
                    next(steps)
                spent[:] = [0.0, 0]
                start = time.process_time()
                for _ in range(tokens):
                    next(steps)
                total = time.process_time() - start
                per_layer.append(spent[0] / spent[1] * 1e3)
                per_token.append((total - spent[0]) / tokens * 1e3)
            engine.close()
            out[policy] = {"experts_ms_per_layer": statistics.median(per_layer),
                           "spread": [min(per_layer), max(per_layer)],
                           "rest_ms_per_token": statistics.median(per_token)}
    finally:
        Engine.experts_forward = real
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trees", nargs="*", type=Path, default=[])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.processes < 1 or args.tokens < 2 or args.rounds < 1:
        parser.error("--processes >= 1, --tokens >= 2, --rounds >= 1")
    model = checkpoint(Path(tempfile.gettempdir()) / "fmoe-host-per-layer-mixtral")
    setups = [(f"{tree.name}: cpu", tree, False) for tree in args.trees] + [("this: cpu", ROOT, False),
                                                                            ("this: device", ROOT, True)]
    figures: dict[str, list[dict]] = {name: [] for name, _, _ in setups}
    for _ in range(args.processes):  # setups alternate, one process each
        for name, tree, device_path in setups:
            figures[name].append(bench(tree, model, device_path, args.tokens, args.rounds))
    counted = waits(model)
    eager = eager_part(model, args.tokens, args.rounds)
    result = {"model": "mixtral 3 layers, hidden 128", "processes": args.processes, "rounds": args.rounds,
              "ms_per_layer": {name: {p: {"median": statistics.median(f[p] for f in runs),
                                          "min": min(f[p] for f in runs), "max": max(f[p] for f in runs)}
                                      for p in POLICIES} for name, runs in figures.items()},
              "host_waits": counted, "segmented_eager_part": eager}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"ms of host work per layer (TPOT / {LAYERS}), median [min-max] over {args.processes} processes of "
          f"{args.rounds} rounds; load {os.getloadavg()[0]:.1f}")
    print(f"{'':18}" + "".join(f"{p:>22}" for p in POLICIES))
    for name, per in result["ms_per_layer"].items():
        print(f"{name:18}" + "".join(f"{v['median']:9.2f} [{v['min']:.2f}-{v['max']:.2f}]" + " " * 2 for v in per.values()))
    print("left eager by a step replayed from graph segments (device path, CPU clock, forecast): " + "; ".join(
        f"{p} {e['experts_ms_per_layer']:.2f} ms a MoE layer [{e['spread'][0]:.2f}-{e['spread'][1]:.2f}] "
        f"(the rest of the step {e['rest_ms_per_token']:.2f} ms a token)" for p, e in eager.items()))
    print("host waits on the device path (counted): " + "; ".join(
        f"{p} {c['per_moe_layer']:.2f} a MoE layer, {c['outside_per_token']:.0f} a token outside" for p, c in counted.items()))


if __name__ == "__main__":
    main()
