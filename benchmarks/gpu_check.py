"""The GPU check (issue 37 §3): what only a GPU can confirm, in one command that fits inside 7 minutes on an H100.

    python benchmarks/gpu_check.py --out DIR               # on a machine with a GPU
    python benchmarks/gpu_check.py --device cpu --parts abc --families mixtral --dtypes float32 --layers 1 \
        --experts 32 --budget 60% --tokens 8 --rounds 2                                      # dry run here
    python benchmarks/gpu_check.py --parts d --trace TRACE --out DIR                         # issue 38 on the GPU
    python benchmarks/gpu_check.py --device cpu --parts d --trace TRACE --mixtral-layers 1 --tokens 2 --rounds 1 \
        --replay-policies lru,resident                                                       # its dry run here

A. Exactness on the device: tiny random checkpoints of every family (fmoe_cli.models.demo, hidden 128; --fp8-families
   also in the block-scaled fp8 layout, transformers' reference dequantized as fmoe reads it), every policy
   at half the expert bytes over the real copy stream (every caching policy loads: a budget holding every expert
   runs them as resident), float32 and bfloat16; each policy's greedy tokens against
   transformers' own `generate` on the same device and dtype (and whether the resident run replayed its decode steps
   from a CUDA graph).
B. Speed on a real link: a checkpoint at Qwen3-30B-A3B's layer shape with --layers layers (bf16, random weights made on
   the device), `fmoe profile --quick --model` (the device's link and the engine's at the model's copies), then `fmoe bench` with resident, moepic, lru, ondemand and hybrid at --budget
   of the expert bytes, --tokens tokens, --rounds interleaved rounds; beside it transformers' `generate` (resident).
   The issue's targets: resident <= 2.0 ms a token at 8 layers; moepic <= resident + 1.25 x (bytes moved / link).
   Then resident without its CUDA graph, moepic with every expert's bytes (a model that fits: the resident plan, one
   graph a step), and `fmoe chat` on the same model, two messages from a pipe (resident): each answer's TPOT.
C. Where a loading policy's step goes: moepic on B's model under cProfile and torch.profiler (its host work, the
   waits, the launches), the top entries into DIR/profile-moepic.txt.
D. MoEpic's table on the GPU (issue 38 §3), when `--trace` names a Mixtral-8x7B routing trace (the HumanEval one the
   CPU table replays; copy it into the checkout and carry it to a lent machine): a checkpoint at Mixtral-8x7B's
   layer shape, `--mixtral-layers` layers, int2 experts (tools/random_checkpoint.py --quantize pool: the bytes,
   kernels and link work of HQQ's int2, in seconds) and int4 attention, every policy at MoEpic's budget per layer
   (5 experts a layer plus the staging pool) over the GPU's own link, routing replayed from the trace, beside the
   simulator's prediction for the same routing, budget and link (benchmarks/replay_routing.py --device cuda).

Every step runs in its own process with a time limit; what a step could not do is one line, and the check goes on.
The summary (markdown, the table docs/bench.md § On a GPU keeps) goes to stdout and DIR/gpu_check.md, the raw
reports to DIR/*.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's fmoe_cli, installed or not (a GPU machine's bare image)
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3")
POLICIES_A = ("resident", "ondemand", "lru", "lfu", "cache-only", "prefetch-only", "uniform", "moepic")
POLICIES_B = ("resident", "moepic", "lru", "ondemand", "hybrid")
PROMPT = "the quick brown fox"
A3B = dict(hidden=2048, heads=32, kv_heads=4, head_dim=128, moe_inter=768, experts=128, top_k=8, vocab=32000)


def fmoe(args: list[str], timeout: float, out: Path | None = None, stdin: str | None = None,
         **environ: str) -> tuple[int, str]:
    """`fmoe ARGS` in a process of its own (this checkout's code), `stdin` its input; stdout to `out` if given. (rc,
    stderr's tail)."""
    return script(["-m", "fmoe_cli.cli", *args], timeout, out, stdin, **environ)


def script(argv: list[str], timeout: float, out: Path | None = None, stdin: str | None = None,
           **environ: str) -> tuple[int, str]:
    """`python ARGV` (a module, or a script of this checkout by its path from the root) in a process of its own, with
    this checkout's code first; stdout to `out` if given. (rc, stderr's tail)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p),
               **environ)
    try:
        done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout, env=env,
                              cwd=ROOT, input=stdin if stdin is not None else "")
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout:.0f} s"
    if out is not None:
        out.write_text(done.stdout)
    return done.returncode, "\n".join(done.stderr.strip().splitlines()[-4:])


def report_of(path: Path) -> dict | None:
    try:
        text = path.read_text()[:50_000_000]
        return json.loads(text[text.find("{"):])
    except (OSError, ValueError):
        return None


def reference_tokens(path: Path, device: str, dtype: str, tokens: int, fp8: bool = False) -> list[int]:
    """transformers' greedy tokens for PROMPT, encoded as fmoe bench encodes it (generate.encode_messages); `fp8`: a
    block-scaled fp8 checkpoint, dequantized as fmoe reads it (on an FP8 GPU transformers would compute in float8)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, FineGrainedFP8Config

    from fmoe_cli.generate import encode_messages

    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = encode_messages(tokenizer, [{"role": "user", "content": PROMPT}], str(path), plain=True)
    extra = {"quantization_config": FineGrainedFP8Config(dequantize=True)} if fp8 else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), **extra).to(device).eval()
    model.generation_config.eos_token_id = None
    x = torch.tensor([ids], device=device)
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=tokens, do_sample=False)
    return out[0, x.shape[1]:].tolist()


def part_a(args, work: Path, out: Path, deadline: float) -> list[str]:
    from fmoe_cli.models.demo import build_random_moe, write_fp8_copy

    lines = ["| family | dtype | policies giving transformers' tokens | resident from a CUDA graph | TPOT resident / moepic (ms) |",
             "|---|---|---|---|---|"]
    for family in [*args.families, *(f"{f}-fp8" for f in args.fp8_families)]:
        path = work / f"tiny-{family}"
        if not path.exists():
            base = family.removesuffix("-fp8")
            build_random_moe(work / f"tiny-{base}", family=base, seed=1, hidden_size=128) \
                if not (work / f"tiny-{base}").exists() else None
            if family.endswith("-fp8"):  # the same weights in the block-scaled fp8 layout
                write_fp8_copy(work / f"tiny-{base}", path)
        for dtype in args.dtypes:
            if time.monotonic() > deadline:
                lines.append(f"| {family} | {dtype} | skipped: the check's time | | |")
                continue
            target = out / f"exact-{family}-{dtype}.json"
            policies = [a for p in POLICIES_A for a in ("--policy", p)]
            rc, err = fmoe(["bench", str(path), "--device", args.device, "--dtype", dtype, *policies,
                            "--vram-budget", "50%", "--tokens", str(args.exact_tokens), "--prompt", PROMPT, "--json"],
                           timeout=150, out=target)
            report = report_of(target)
            if rc != 0 or report is None:
                lines.append(f"| {family} | {dtype} | fmoe bench failed (rc {rc}): {err.splitlines()[-1] if err else ''} | | |")
                continue
            want = reference_tokens(path, args.device, dtype, args.exact_tokens, fp8=family.endswith("-fp8"))
            runs = {r["policy"]: r for r in report["runs"]}
            same = [p for p, r in runs.items() if r["token_ids"] == want]
            differ = [f"{p} at {next((i for i, (a, b) in enumerate(zip(r['token_ids'], want)) if a != b), len(want))}"
                      for p, r in runs.items() if p not in same]
            tpot = " / ".join(f"{runs[p]['tpot_ms']['median']:.2f}" for p in ("resident", "moepic") if p in runs)
            lines.append(f"| {family} | {dtype} | {len(same)}/{len(runs)}" + (f" (differ: {', '.join(differ)})" if differ
                         else "") + f" | {runs.get('resident', {}).get('decode_graph')} | {tpot} |")
    return lines


def build_a3b(path: Path, layers: int, device: str, experts: int) -> None:
    """Random weights at Qwen3-30B-A3B's layer shape, `layers` layers, bf16 safetensors, made on the device; the
    shipped demo's tokenizer."""
    import shutil

    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3MoeConfig

    s = dict(A3B, experts=experts)
    h, nq, nkv, hd, inter, e, vocab = s["hidden"], s["heads"], s["kv_heads"], s["head_dim"], s["moe_inter"], s["experts"], s["vocab"]
    config = Qwen3MoeConfig(vocab_size=vocab, hidden_size=h, intermediate_size=2 * h, num_hidden_layers=layers,
                            num_attention_heads=nq, num_key_value_heads=nkv, head_dim=hd, moe_intermediate_size=inter,
                            num_experts=e, num_experts_per_tok=s["top_k"], norm_topk_prob=True, decoder_sparse_step=1,
                            mlp_only_layers=[], max_position_embeddings=4096, tie_word_embeddings=False,
                            rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    config.architectures = ["Qwen3MoeForCausalLM"]
    config.dtype = "bfloat16"
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    demo = ROOT / "fmoe_cli" / "models" / "demo_model"
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (demo / name).exists():
            shutil.copy(demo / name, path)
    generator = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape, std=0.02):
        return (torch.randn(*shape, generator=generator, device=device) * std).to(torch.bfloat16).cpu()

    ones = lambda n: torch.ones(n, dtype=torch.bfloat16)  # noqa: E731
    weights = {"model.embed_tokens.weight": rnd(vocab, h), "lm_head.weight": rnd(vocab, h), "model.norm.weight": ones(h)}
    for layer in range(layers):
        p = f"model.layers.{layer}."
        weights.update({p + "input_layernorm.weight": ones(h), p + "post_attention_layernorm.weight": ones(h),
                        p + "self_attn.q_proj.weight": rnd(nq * hd, h), p + "self_attn.k_proj.weight": rnd(nkv * hd, h),
                        p + "self_attn.v_proj.weight": rnd(nkv * hd, h), p + "self_attn.o_proj.weight": rnd(h, nq * hd),
                        p + "self_attn.q_norm.weight": ones(hd), p + "self_attn.k_norm.weight": ones(hd),
                        p + "mlp.gate.weight": rnd(e, h, std=0.5)})
        for expert in range(e):
            q = f"{p}mlp.experts.{expert}."
            weights.update({q + "gate_proj.weight": rnd(inter, h), q + "up_proj.weight": rnd(inter, h),
                            q + "down_proj.weight": rnd(h, inter)})
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})


def transformers_tpot(path: Path, device: str, tokens: int) -> float:
    """transformers' own generate on the whole model (resident), bf16: ms a decode token (the step's median)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    model.generation_config.eos_token_id = None
    x = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11]], device=device)
    times = []
    with torch.no_grad():
        for n in (2, 2 + tokens):  # the difference of two lengths: decode steps alone
            model.generate(x, max_new_tokens=n, do_sample=False)  # warm
            if device.startswith("cuda"):
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            model.generate(x, max_new_tokens=n, do_sample=False)
            if device.startswith("cuda"):
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
    return (times[1] - times[0]) * 1000 / tokens


PART_B_MIN_S = 150  # part B's least time: the a3b build, a quick profile, the bench (else it is skipped, said)


def part_b(args, work: Path, out: Path, deadline: float) -> list[str]:
    path = work / f"a3b-x{args.layers}"
    if deadline - time.monotonic() < PART_B_MIN_S:
        return [f"skipped: {deadline - time.monotonic():.0f} s left of --seconds, part B needs {PART_B_MIN_S}"]
    started = time.monotonic()
    if not (path / "model.safetensors").exists():
        build_a3b(path, args.layers, args.device, args.experts)
    lines = [f"a3b-shaped model, {args.layers} layers, {args.experts} experts of 2048 x 768, bf16 "
             f"(built in {time.monotonic() - started:.0f} s)", ""]
    # the model's profile (saved where the bench finds it: its quick estimate is not measured again): the device's
    # link (plain copies) and the engine's own link at this model's copies (issue 37 §5), one line each
    rc, err = fmoe(["profile", "--quick", "--model", str(path), "--device", args.device, "--json"],
                   timeout=max(30, min(240, deadline - time.monotonic() - 60)), out=out / "profile.json")
    profile = (report_of(out / "profile.json") or {}).get("profile") or {}
    links = [("the device's", profile.get("device", {}).get("link")), ("the engine's", (profile.get("model") or {}).get("link"))]
    lines += [f"`fmoe profile --quick --model`, {whose} link: {link['bandwidth'] / 1e9:.1f} GB/s, latency "
              f"{(link.get('latency') or 0) * 1e6:.0f} µs ({link.get('note', '')}; (MiB, ms): "
              f"{', '.join(f'({b / 2**20:.2f}, {t * 1e3:.3f})' for b, t in link.get('samples', []))})"
              for whose, link in links if link] or [f"profile failed (rc {rc}): {err}"]
    left = deadline - time.monotonic()
    target = out / "a3b.json"
    policies = [a for p in POLICIES_B for a in ("--policy", p)]
    rc, err = fmoe(["bench", str(path), "--device", args.device, *policies, "--vram-budget", args.budget,
                    "--tokens", str(args.tokens), "--rounds", str(args.rounds), "--json"], timeout=max(left - 40, 30),
                   out=target)
    report = report_of(target)
    if rc != 0 or report is None:
        return lines + [f"fmoe bench failed (rc {rc}): {err}"]
    lines += ["", f"| policy (budget {args.budget} of the expert bytes) | TPOT ms (rounds' min-max) | link MB/token | "
              f"CUDA graph segments a step |", "|---|---:|---:|---|"]
    for r in report["runs"]:
        per_round = [x["tpot_ms"]["median"] for x in r.get("rounds", [r])]
        lines.append(f"| {r['policy']} | {r['tpot_ms']['median']:.2f} ({min(per_round):.2f}-{max(per_round):.2f}) | "
                     f"{r['bytes_per_token'] / 1e6:.0f} | {r.get('decode_segments') or 'eager'} |")
    lines.append(f"token ids identical across policies: {report['token_ids_identical']}; plan of moepic: "
                 + next((r["plan"] for r in report["runs"] if r["policy"] == "moepic"), "-"))
    if time.monotonic() < deadline - 40:  # the resident step without its CUDA graph: what the graph saves
        target = out / "a3b-eager.json"
        rc, err = fmoe(["bench", str(path), "--device", args.device, "--policy", "resident", "--tokens",
                        str(args.tokens), "--json"], timeout=max(deadline - time.monotonic() - 20, 20), out=target,
                       FMOE_CUDA_GRAPHS="0")
        eager = report_of(target)
        lines.append(f"resident with FMOE_CUDA_GRAPHS=0 (eager steps, one round): " + (
            f"{eager['runs'][0]['tpot_ms']['median']:.2f} ms a token" if rc == 0 and eager else f"failed (rc {rc}): {err}"))
    if time.monotonic() < deadline - 40:  # a model that fits: a caching policy runs the resident plan, one graph
        target = out / "a3b-fits.json"
        rc, err = fmoe(["bench", str(path), "--device", args.device, "--policy", "moepic", "--vram-budget", "100%",
                        "--tokens", str(args.tokens), "--json"], timeout=max(deadline - time.monotonic() - 20, 20),
                       out=target)
        fits = report_of(target)
        run = fits["runs"][0] if rc == 0 and fits else None
        lines.append("moepic with every expert's bytes (--vram-budget 100%, one round): " + (
            f"{run['tpot_ms']['median']:.2f} ms a token, CUDA graph segments a step: {run.get('decode_segments') or 'eager'}, "
            f"plan {run['plan']}" if run else f"failed (rc {rc}): {err}"))
    if time.monotonic() < deadline - 40:  # a conversation: its second turn continues the first's static cache
        lines.append(chat_line(path, args, out, deadline))
    if time.monotonic() < deadline - 20:
        try:
            lines.append(f"transformers' generate (resident, bf16): {transformers_tpot(path, args.device, 16):.2f} ms "
                         f"a token")
        except Exception as exc:  # the comparison is a side figure: the check goes on
            lines.append(f"transformers' generate: failed ({str(exc).splitlines()[0][:120]})")
    return lines


def chat_line(path: Path, args, out: Path, deadline: float) -> str:
    """`fmoe chat` (resident, greedy) answering two messages from a pipe: each answer's TPOT from its footer. On a GPU
    the conversation's KV cache is the engine's static cache, its decode steps replayed from the CUDA graph captured in
    the first answer (generate.conversation_cache): both answers should read about bench's graphed resident TPOT."""
    target = out / "chat.txt"
    rc, err = fmoe(["chat", str(path), "--device", args.device, "--policy", "resident", "--temperature", "0",
                    "--max-new-tokens", str(args.tokens), "--context", "1024"],
                   timeout=max(deadline - time.monotonic() - 20, 20), out=target,
                   stdin="Explain what an expert is.\nAnd a router?\n")
    text = target.read_text()[:200_000] if target.exists() else ""
    tpots = [part.split("TPOT", 1)[1].split("ms", 1)[0].strip() for part in text.splitlines() if "TPOT" in part]
    if rc != 0 or len(tpots) != 2:
        return f"fmoe chat (resident, two messages): failed (rc {rc}, {len(tpots)} footers): {err}"
    return f"fmoe chat (resident, two messages, the second on the first's cache): TPOT {tpots[0]} / {tpots[1]} ms"


def part_c(args, work: Path, out: Path, deadline: float) -> list[str]:
    """Where a loading policy's decode step goes on the GPU (the host's side): `fmoe bench --policy moepic` on part B's
    model under cProfile (the engine's Python, the waits in it) and torch.profiler (launches, copies, synchronisations),
    the top entries of each into DIR/profile-moepic.txt. (Part B builds the model; C alone builds it too.)"""
    path = work / f"a3b-x{args.layers}"
    if not (path / "model.safetensors").exists():
        build_a3b(path, args.layers, args.device, args.experts)
    target = out / "profile-moepic.txt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p))
    try:
        done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--profile-step", str(path), str(target),
                               "--device", args.device, "--budget", args.budget, "--tokens", str(min(args.tokens, 16))],
                              capture_output=True, text=True, env=env, cwd=ROOT,
                              timeout=max(deadline - time.monotonic() - 10, 20))
        rc, err = done.returncode, "\n".join(done.stderr.strip().splitlines()[-3:])
    except subprocess.TimeoutExpired:
        rc, err = 124, "timed out"
    if rc != 0 or not target.exists():
        return [f"profile of moepic's steps failed (rc {rc}): {err}"]
    return [f"profile of moepic's decode steps (cProfile and torch.profiler): {target.name}", "",
            "```", *target.read_text()[:6000].splitlines()[:60], "```"]


def part_d(args, work: Path, out: Path, deadline: float) -> list[str]:
    """Issue 38's table on the device: replay_routing.py on a Mixtral-8x7B-shaped int2/int4 checkpoint."""
    if args.trace is None:
        return ["skipped: part D needs --trace, a Mixtral-8x7B routing trace"]
    path = work / f"mixtral-int2-x{args.mixtral_layers}"
    started = time.monotonic()
    if not (path / "config.json").exists():
        rc, err = script(["tools/random_checkpoint.py", str(path), "--shape", "mixtral-8x7b", "--layers",
                          str(args.mixtral_layers), "--experts", "int2", "--quantize", "pool", "--device", args.device],
                         timeout=max(deadline - time.monotonic() - 60, 30))
        if rc != 0:
            return [f"building the Mixtral-shaped checkpoint failed (rc {rc}): {err}"]
    lines = [f"Mixtral-8x7B-shaped model, layers: {args.mixtral_layers}, int2 experts (pool), int4 attention (built in "
             f"{time.monotonic() - started:.0f} s); routing replayed from {Path(args.trace).name}", ""]
    target = out / "replay-routing.json"
    rc, err = script(["benchmarks/replay_routing.py", str(path), str(args.trace), "--device", args.device,
                      "--policies", args.replay_policies, "--rounds", str(args.rounds), "--tokens", str(args.tokens),
                      "--json"], timeout=max(deadline - time.monotonic() - 10, 30), out=target)
    report = report_of(target)
    if rc != 0 or report is None:
        return lines + [f"replay_routing.py failed (rc {rc}): {err}"]
    extra = report["replay_routing"]
    runs = {r["policy"]: r for r in report["runs"]}
    lru = runs.get("lru", {}).get("tpot_ms", {}).get("median")
    lines += [f"link {extra['gbps']:.3g} GB/s ({extra['card']}), one expert's load ÷ T_exp "
              f"{extra['load_over_compute']:.1f}; budget {extra['budget_experts']:.0f} experts; {report['rounds']} rounds "
              f"of {report['tokens']} tokens", "",
              "| policy | TPOT ms (rounds' min-max) | ÷ lru | hit rate | simulated ÷ measured |",
              "|---|---:|---:|---:|---:|"]
    for name, r in runs.items():
        per_round = [x["tpot_ms"]["median"] for x in r.get("rounds", [r])]
        tpot = r["tpot_ms"]["median"]
        simulated = extra["simulated"][name]["profile"]["tpot_ms"]
        ratio = f"{tpot / lru:.2f}" if lru else ""
        lines.append(f"| {name} | {tpot:.2f} ({min(per_round):.2f}-{max(per_round):.2f}) | {ratio} | "
                     f"{r['hit_rate']:.2f} | {simulated / tpot:.2f} |")
    lines.append(f"(`{extra['command']}`)")
    return lines


def profile_step(args) -> None:
    """--profile-step MODEL OUT: one `fmoe bench --policy moepic` run in this process, its bench_policy under cProfile
    and torch.profiler; the top functions and ops to OUT."""
    import cProfile
    import io
    import pstats

    import torch
    from torch.profiler import ProfilerActivity, profile

    import fmoe_cli.bench.run as bench_run
    from fmoe_cli import cli

    model, target = args.profile_step
    python = cProfile.Profile()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    traced = profile(activities=activities)
    measured = bench_run.bench_policy

    def bench_policy(*a, **k):
        with traced:
            python.enable()
            try:
                return measured(*a, **k)
            finally:
                python.disable()

    bench_run.bench_policy = bench_policy
    sys.argv = ["fmoe", "bench", model, "--device", args.device, "--policy", "moepic", "--vram-budget", args.budget,
                "--tokens", str(args.tokens), "--warmup", "4", "--json"]
    try:
        cli.main()
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
    text = io.StringIO()
    stats = pstats.Stats(python, stream=text)
    text.write("cProfile, by cumulative time (fmoe_cli):\n")
    stats.sort_stats("cumulative").print_stats("fmoe_cli", 25)
    text.write("cProfile, by own time:\n")
    stats.sort_stats("tottime").print_stats(20)
    text.write("torch.profiler, by self CPU time:\n")
    text.write(traced.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    Path(target).write_text(text.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--parts", default="abc", help="a: exactness, b: speed, c: a profile of moepic's steps, d: "
                        "issue 38's table (needs --trace), in the order given (default: abc)")
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--fp8-families", nargs="*", default=["qwen3_moe"], choices=FAMILIES,
                        help="part A: these families' checkpoints in the block-scaled fp8 layout too")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--exact-tokens", type=int, default=24)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=128, help="experts a layer of the a3b-shaped model (dry runs: fewer)")
    parser.add_argument("--budget", default="20%")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=400, help="the whole check's time; steps past it are skipped")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--trace", type=Path, default=None, help="part D: a Mixtral-8x7B routing trace")
    parser.add_argument("--mixtral-layers", type=int, default=4, help="part D: the Mixtral-shaped model's layers")
    parser.add_argument("--replay-policies", default="moepic,lru,lfu,prefetch-only,ondemand,resident",
                        help="part D's policies")
    parser.add_argument("--profile-step", nargs=2, metavar=("MODEL", "OUT"), help=argparse.SUPPRESS)  # part C's process
    args = parser.parse_args()
    if args.profile_step:
        return profile_step(args)
    if (not set(args.parts) <= set("abcd") or args.layers < 1 or args.experts < 8 or args.rounds < 1 or args.tokens < 2
            or args.mixtral_layers < 1):
        parser.error("--parts takes a, b, c and d; --layers >= 1, --experts >= 8, --rounds >= 1, --tokens >= 2, "
                     "--mixtral-layers >= 1")
    if "d" in args.parts and args.trace is not None and not args.trace.is_file():
        parser.error(f"--trace {args.trace}: no such file")
    out = args.out or Path(tempfile.mkdtemp(prefix="fmoe-gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.gettempdir()) / "fmoe-gpu-check"
    start = time.monotonic()
    deadline = start + args.seconds
    import torch

    name = torch.cuda.get_device_name(torch.device(args.device)) if args.device.startswith("cuda") else "cpu (dry run)"
    lines = [f"# GPU check, {time.strftime('%Y-%m-%d')}, {name}, torch {torch.__version__}", ""]
    print("\n".join(lines), flush=True)
    for part in args.parts:  # in the order given
        if part == "a":
            section = ["## A. Exactness against transformers on the device", ""] + part_a(args, work, out, deadline)
        elif part == "b":
            section = ["## B. Speed on the real link", ""] + part_b(args, work, out, deadline)
        elif part == "c":
            section = ["## C. Where moepic's step goes", ""] + part_c(args, work, out, deadline)
        else:
            section = ["## D. MoEpic's table on the device (issue 38)", ""] + part_d(args, work, out, deadline)
        lines += section + [""]
        print("\n".join(section), flush=True)
        (out / "gpu_check.md").write_text("\n".join(lines) + "\n")  # each section kept, should a later one be killed
    lines.append(f"(the check took {time.monotonic() - start:.0f} s)")
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")
    print(lines[-1])


if __name__ == "__main__":
    main()
