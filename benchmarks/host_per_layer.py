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

`--paired OLD_TREE` resolves a change of a few per cent, which interleaved processes do not (one process's start, its
memory layout and the load of that minute move a reading by 5-10 %): worker processes, two of this tree and two of
OLD_TREE, each with the measure's model and an engine per policy (plans from fixed timings: the same plan in both
trees), kept alive and run in turn, blocks of `--tokens` decode tokens per policy in the order A B B A (a drift in the
machine's speed cancels within a pair; pairs alternate between a tree's two processes), every token's latency on the
CPU clock (FMOE_EMULATED_CLOCK=cpu: the link's modelled waits included); per policy the ratio this ÷ OLD of each pair,
median [min-max], and each tree's median ms a layer. `--paired` with this tree itself (an A/A) reads the floor of
what it resolves.

    python benchmarks/host_per_layer.py --paired OLD_TREE [--pairs 12] [--tokens 48] [--device-path] [--json]
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


def worker(model: Path, device_path: bool) -> None:
    """`--worker`: the paired mode's process, in the tree its PYTHONPATH names. Builds an engine per policy, then
    answers each line `POLICY TOKENS` on stdin with one JSON line: the ms a layer of TOKENS decode tokens (median of
    their latencies on fmoe's clock, ÷ LAYERS) after 4 unmeasured ones."""
    sys.path.insert(0, os.getcwd())  # the tree's fmoe_cli (its cwd), not this script's (ROOT, put first above)
    import torch

    import fmoe_cli
    from fmoe_cli.generate import stream_generate
    from fmoe_cli.offload.link import host_now

    torch.set_num_threads(1)
    engines = {}
    for policy in POLICIES:
        lm, engine = device_path_engine(model, policy)
        engine.device_side = device_path
        engines[policy] = (lm, engine)
    print(json.dumps({"package": str(Path(fmoe_cli.__file__).resolve().parent.parent)}), flush=True)
    for line in sys.stdin:
        policy, tokens = line.split()
        lm, engine = engines[policy]
        steps = stream_generate(lm.model, torch.tensor([list(range(5, 40))]), engine=engine,
                                max_new_tokens=int(tokens) + 4, stop_on_eos=False)
        for _ in range(4):
            next(steps)
        latencies = []
        for _ in range(int(tokens)):
            start = host_now()
            next(steps)
            latencies.append(host_now() - start)
        print(json.dumps({"ms_per_layer": statistics.median(latencies) * 1e3 / LAYERS}), flush=True)


def paired(old_tree: Path, model: Path, pairs: int, tokens: int, device_path: bool) -> dict:
    """The `--paired` A/B: this tree (A) against `old_tree` (B), blocks in the order A B B A, per policy."""
    trees = {"this": ROOT, "old": old_tree}
    env = dict(os.environ, FMOE_KERNELS="torch", OMP_NUM_THREADS="1", FMOE_EMULATED_CLOCK="cpu")
    workers = {}
    for name in ("this", "old", "old 2", "this 2"):  # two a tree, started A B B A (a process's own speed averages out)
        tree = trees[name.split()[0]]
        workers[name] = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker", "--model", str(model)]
            + (["--device-path"] if device_path else []),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=tree, env=dict(env, PYTHONPATH=str(tree)))

    def ask(name: str, request: str) -> dict:
        process = workers[name]
        if request:
            process.stdin.write(request + "\n")
            process.stdin.flush()
        answer = process.stdout.readline()
        if not answer:
            raise SystemExit(f"error: the {name} tree's worker stopped (run it alone to see why)")
        return json.loads(answer)

    try:
        for name in workers:  # its engines are built, from its own tree's package
            package = Path(ask(name, "")["package"])
            if package != trees[name.split()[0]].resolve():
                raise SystemExit(f"error: the {name} tree's worker imported fmoe_cli from {package}")
        per = {p: {"this": [], "old": [], "ratios": []} for p in POLICIES}
        for pair in range(pairs):
            this, old = ("this", "old") if pair % 2 == 0 else ("this 2", "old 2")
            for policy in POLICIES:
                a1 = ask(this, f"{policy} {tokens}")["ms_per_layer"]
                b1 = ask(old, f"{policy} {tokens}")["ms_per_layer"]
                b2 = ask(old, f"{policy} {tokens}")["ms_per_layer"]
                a2 = ask(this, f"{policy} {tokens}")["ms_per_layer"]
                figures = per[policy]
                figures["this"] += [a1, a2]
                figures["old"] += [b1, b2]
                figures["ratios"].append((a1 + a2) / (b1 + b2))
    finally:
        for process in workers.values():
            process.stdin.close()
            process.wait(timeout=60)
    return {policy: {"ratio": {"median": statistics.median(f["ratios"]), "min": min(f["ratios"]),
                               "max": max(f["ratios"]), "pairs": len(f["ratios"])},
                     "this_ms_per_layer": statistics.median(f["this"]), "old_ms_per_layer": statistics.median(f["old"])}
            for policy, f in per.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trees", nargs="*", type=Path, default=[])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--paired", type=Path, metavar="OLD_TREE", help="paired A/B against this source tree")
    parser.add_argument("--pairs", type=int, default=12)
    parser.add_argument("--device-path", action="store_true", help="--paired on the device path (FMOE_DEVICE_PATH)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.processes < 1 or args.tokens < 2 or args.rounds < 1 or args.pairs < 1:
        parser.error("--processes >= 1, --tokens >= 2, --rounds >= 1, --pairs >= 1")
    if args.paired is not None and not (args.paired / "fmoe_cli").is_dir():
        parser.error(f"--paired {args.paired}: not a source tree of fmoe (no fmoe_cli in it)")
    if args.worker:
        worker(args.model, args.device_path)
        return
    model = checkpoint(Path(tempfile.gettempdir()) / "fmoe-host-per-layer-mixtral")
    if args.paired is not None:
        result = paired(args.paired, model, args.pairs, args.tokens, args.device_path)
        if args.json:
            print(json.dumps({"paired": str(args.paired), "device_path": args.device_path, "tokens": args.tokens,
                              "policies": result}, indent=1))
            return
        print(f"this tree ÷ {args.paired}, {'device' if args.device_path else 'cpu'} path, CPU clock, {args.pairs} "
              f"pairs of {args.tokens} tokens (A B B A); load {os.getloadavg()[0]:.1f}")
        for policy, r in result.items():
            ratio = r["ratio"]
            print(f"{policy:9} {ratio['median']:.3f} [{ratio['min']:.3f}-{ratio['max']:.3f}]   ms a layer: this "
                  f"{r['this_ms_per_layer']:.3f}, old {r['old_ms_per_layer']:.3f}")
        return
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
