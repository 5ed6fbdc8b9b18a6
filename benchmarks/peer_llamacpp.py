#!/usr/bin/env python3
"""fmoe against llama.cpp on the CPU: `fmoe bench --policy resident` against `llama-bench`, the same checkpoints
and weight formats, the two interleaved (llama.cpp, fmoe, llama.cpp, fmoe, …), one summary line per cell.

    python benchmarks/peer_llamacpp.py                        # a3b, big and demo; 3 rounds of 64 tokens (~25 min, ~50 GB)
    python benchmarks/peer_llamacpp.py --models a3b big --rounds 2
    python benchmarks/peer_llamacpp.py --quick                # demo, f32 and q4, 1 round of 16 tokens: a smoke run

What it does, each step only where its result is not already in the cache directory (--cache-dir, default
$XDG_CACHE_HOME/fmoe-peer; a second run costs only the measuring):

1. llama.cpp: the llama-cpp-python sdist (it vendors llama.cpp), fetched with pip from the package registry, and
   its `llama-bench` and `llama-quantize` built for this CPU with cmake (ninja where present; ~4 min on 2 idle
   cores): `-march=native`, or where the CPU lists AMX every other extension it has (`cpu_flags`).
2. Checkpoints (bf16 safetensors, per-expert keys, the demo's tokenizer): `demo` (fmoe's shipped demo model),
   `big` (random weights: hidden 1024, 8 layers, 16/4 heads × 64, 64 experts × 512, top-8: 0.89 B parameters) and
   `a3b` (random weights, Qwen3-30B-A3B's layer shape: hidden 2048, 32/4 heads × 128, 128 experts × 768, top-8,
   with 4 of its 48 layers: 2.62 B).
3. GGUFs: bf16 by llama.cpp's own converter (a copy whose unknown BPE pre-tokenizer falls back to gpt-2: the demo
   tokenizer's hash is not in its list), then F32, F16, Q8_0 and Q4_0 by llama-quantize.
4. A quiet machine: waits up to --max-wait s for a load average under 0.6, then measures the copy bandwidth.
5. --rounds rounds: per model and format llama-bench (-p 64 -n TOKENS -r 3) then fmoe bench (f32 =
   `--dtype float32 --experts bf16`, bf16 = `--dtype bfloat16 --experts bf16`, q8 = `--experts int8` against
   Q8_0, q4 = `--experts int4` against Q4_0; f16 is llama.cpp's only). Each run first waits up to --run-wait s for
   the other processes to leave it its --threads cores; the rounds in which they did are the "clean" ones, and a
   cell's figure is the median of its clean rounds (of all, when none was clean).
6. Per cell: decode TPOT of both and fmoe ÷ llama.cpp, prefill tokens/s of both (64 tokens), the weight bytes one
   decode token reads in each, and the share of the bandwidth floor (bytes ÷ copy bandwidth) each reaches. A table
   on stderr, one line per cell on stdout (`--json`: one JSON object instead); every run's raw output and the
   summary.json that benchmarks/peer_gap.py reads under CACHE/results/run-*/.

Needs: Linux (/proc), cmake and a C++ compiler, pip access to the package registry, and the fmoe environment's
numpy, pyyaml, tqdm and requests (llama.cpp's converter). Disk the first time: a3b ~35 GB, big ~12 GB, demo
< 0.3 GB, the build 0.4 GB (checked before anything is written); 16 GB of RAM for a3b. fmoe's config and cache
directories are redirected under the cache directory; nothing is written to the checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "fmoe_cli" / "models" / "demo_model"
LLAMA_CPP_PYTHON = "0.3.36"  # the sdist whose vendored llama.cpp is built
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               "-DLLAMA_BUILD_SERVER=OFF"]
# /proc/cpuinfo flag: ggml's option, for a build of every vector extension the CPU has but AMX (cpu_flags)
GGML_EXTENSIONS = {"avx": "GGML_AVX", "avx2": "GGML_AVX2", "fma": "GGML_FMA", "f16c": "GGML_F16C", "bmi2": "GGML_BMI2",
                   "avx512f": "GGML_AVX512", "avx512vbmi": "GGML_AVX512_VBMI", "avx512_vnni": "GGML_AVX512_VNNI",
                   "avx512_bf16": "GGML_AVX512_BF16", "avx_vnni": "GGML_AVX_VNNI"}
MODELS = ("a3b", "big", "demo")
# name: (hidden, layers, q heads, kv heads, head dim, expert width, experts, top-k)
SHAPES = {"big": (1024, 8, 16, 4, 64, 512, 64, 8), "a3b": (2048, 4, 32, 4, 128, 768, 128, 8)}
BF16_GB = {"demo": 0.035, "big": 1.79, "a3b": 5.25}  # each checkpoint's bf16 bytes, for the disk check
# label: (GGUF type, its size ÷ bf16's, fmoe bench's options or None: llama.cpp only)
FORMATS = {
    "f32": ("f32", 2.0, ["--dtype", "float32", "--experts", "bf16"]),
    "bf16": ("bf16", 1.0, ["--dtype", "bfloat16", "--experts", "bf16"]),
    "q8": ("q8_0", 0.54, ["--dtype", "float32", "--experts", "int8"]),
    "q4": ("q4_0", 0.29, ["--dtype", "float32", "--experts", "int4"]),
    "f16": ("f16", 1.0, None),
}
# fmoe's bytes a weight per format: (compute dtype bytes, expert bits): int8 8 + 16/128, int4 4 + 32/64
FMOE_BITS = {"f32": (4, 32), "bf16": (2, 16), "q8": (4, 8.125), "q4": (4, 4.5)}
QUICK = {"models": ["demo"], "formats": ["f32", "q4"], "rounds": 1, "tokens": 16, "max_wait": 0, "run_wait": 0}
PROMPT = ("Explain in a few sentences how a mixture-of-experts model decides which experts to use. Describe the "
          "router, the top-k selection, the load balancing loss, and")  # 64 tokens with the chat template
QUIET_LOAD = 0.6


def log(message: str) -> None:
    print(f"peer: {message}", file=sys.stderr, flush=True)


def die(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(1)


# --- 1. llama.cpp ---------------------------------------------------------------------------------------------
def llama_source(cache: Path) -> Path:
    """The vendored llama.cpp of the llama-cpp-python sdist, fetched with pip and unpacked once."""
    sdist = cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}"
    llama = sdist / "vendor" / "llama.cpp"
    if not (llama / "CMakeLists.txt").is_file():
        import tarfile

        log(f"fetching the llama-cpp-python {LLAMA_CPP_PYTHON} sdist (it vendors llama.cpp)")
        run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(cache)], cache / "pip_download.log")
        archive = cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
        with tarfile.open(archive) as tar:
            tar.extractall(cache, filter="data")  # no path outside the cache directory
        archive.unlink()
    return llama


def cpu_flags(cpuinfo: str) -> list[str]:
    """ggml's options for this CPU: -march=native, except where the CPU lists AMX. A VM may list AMX without granting
    its tile state, and a native build's quantised prefill then dies in ggml's AMX matmul (SIGSEGV or SIGILL): there,
    every other vector extension the CPU lists, named one by one."""
    flags = set(next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), []))
    if not any(f.startswith("amx") for f in flags):
        return ["-DGGML_NATIVE=ON"]
    return ["-DGGML_NATIVE=OFF"] + [f"-D{option}={'ON' if flag in flags else 'OFF'}"
                                    for flag, option in GGML_EXTENSIONS.items()]


def build_llama(cache: Path, llama: Path, flags: list[str]) -> Path:
    """llama-bench and llama-quantize for this CPU; the build directory's bin/. Built again when the flags differ
    from the build's (build/fmoe-cmake-flags.txt)."""
    build = cache / "build"
    tools = build / "bin"
    stamp = build / "fmoe-cmake-flags.txt"
    built = stamp.read_text() if stamp.is_file() else None
    if not ((tools / "llama-bench").exists() and (tools / "llama-quantize").exists()) or built != " ".join(flags):
        generator = ["-G", "Ninja"] if shutil.which("ninja") and not (build / "CMakeCache.txt").exists() else []
        log(f"building llama.cpp (log: {cache / 'build.log'})")
        run(["cmake", "-B", str(build), "-S", str(llama), *generator, *flags], cache / "cmake_configure.log")
        run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 1), "--target", "llama-bench",
             "llama-quantize"], cache / "build.log")
        stamp.write_text(" ".join(flags))
    return tools


def llama_version(tools: Path, llama: Path) -> tuple[str, str]:
    """llama-bench's version line and llama.cpp's commit (the sdist's changelog names it)."""
    import re

    version = subprocess.run([str(tools / "llama-bench"), "--version"], capture_output=True, text=True)
    line = (version.stdout + version.stderr).strip().splitlines()[:1]
    changelog = llama.parents[1] / "CHANGELOG.md"
    commit = "unknown"
    if changelog.is_file():
        found = re.search(r"llama\.cpp@([0-9a-f]{7,40})", changelog.read_text(encoding="utf-8")[:1 << 20])
        commit = found.group(1) if found else commit
    return (line[0] if line else "unknown"), commit


def converter(cache: Path, llama: Path) -> Path:
    """A copy of llama.cpp's convert_hf_to_gguf.py whose unknown BPE pre-tokenizer falls back to gpt-2 (the demo
    tokenizer is a GPT-2-style byte-level BPE whose hash the vendored converter does not list)."""
    copy = cache / "convert"
    base = copy / "conversion" / "base.py"
    if (copy / "convert_hf_to_gguf.py").is_file() and base.is_file() and "PATCHED COPY" in base.read_text():
        return copy
    shutil.rmtree(copy, ignore_errors=True)
    copy.mkdir(parents=True)
    shutil.copy(llama / "convert_hf_to_gguf.py", copy)
    shutil.copytree(llama / "conversion", copy / "conversion")
    text = base.read_text()
    refusal = '            raise NotImplementedError("BPE pre-tokenizer was not recognized - update get_vocab_base_pre()")'
    if text.count(refusal) != 1:
        die(f"llama.cpp's converter changed: no place to patch in {base}")
    base.write_text(text.replace(refusal, '            logger.warning("PATCHED COPY: unrecognised pre-tokenizer, '
                                          'defaulting to gpt-2"); res = "gpt-2"'))
    return copy


# --- 2. checkpoints -------------------------------------------------------------------------------------------
def write_random_model(shape: str, out: Path) -> None:
    """A random-weight Qwen3-MoE checkpoint of SHAPES[shape] (bf16 safetensors, per-expert keys, seeded) with the
    demo's tokenizer files."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3MoeConfig

    hidden, layers, heads, kv_heads, head_dim, width, experts, top_k = SHAPES[shape]
    out.mkdir(parents=True, exist_ok=True)
    config = Qwen3MoeConfig(  # intermediate_size (a dense MLP) is unused: every layer is an MoE layer
        vocab_size=32000, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, moe_intermediate_size=width,
        num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-6,
        pad_token_id=0, eos_token_id=1, bos_token_id=None)
    config.architectures = ["Qwen3MoeForCausalLM"]
    config.dtype = "bfloat16"
    config.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (DEMO / name).exists():
            shutil.copy(DEMO / name, out)
    g = torch.Generator().manual_seed(0)

    def rnd(*size, std=0.02):
        return (torch.randn(*size, generator=g, dtype=torch.float32) * std).to(torch.bfloat16)

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    vocab = config.vocab_size
    state = {"model.embed_tokens.weight": rnd(vocab, hidden), "lm_head.weight": rnd(vocab, hidden),
             "model.norm.weight": ones(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        state |= {p + "input_layernorm.weight": ones(hidden), p + "post_attention_layernorm.weight": ones(hidden),
                  p + "self_attn.q_proj.weight": rnd(heads * head_dim, hidden),
                  p + "self_attn.k_proj.weight": rnd(kv_heads * head_dim, hidden),
                  p + "self_attn.v_proj.weight": rnd(kv_heads * head_dim, hidden),
                  p + "self_attn.o_proj.weight": rnd(hidden, heads * head_dim),
                  p + "self_attn.q_norm.weight": ones(head_dim), p + "self_attn.k_norm.weight": ones(head_dim),
                  p + "mlp.gate.weight": rnd(experts, hidden, std=0.5)}  # the router: spread-out logits
        for e in range(experts):
            q = f"{p}mlp.experts.{e}."
            state |= {q + "gate_proj.weight": rnd(width, hidden), q + "up_proj.weight": rnd(width, hidden),
                      q + "down_proj.weight": rnd(hidden, width)}
    save_file(state, out / "model.safetensors.tmp", metadata={"format": "pt"})
    os.replace(out / "model.safetensors.tmp", out / "model.safetensors")
    log(f"{shape}: {sum(t.numel() for t in state.values()) / 1e6:.1f} M parameters")


def checkpoint(cache: Path, model: str) -> Path:
    out = cache / "models" / model
    if not (out / "model.safetensors").is_file():
        if model == "demo":
            out.mkdir(parents=True, exist_ok=True)
            for f in DEMO.iterdir():
                if f.is_file():
                    shutil.copy(f, out)
        else:
            log(f"writing the random-weight {model} checkpoint")
            write_random_model(model, out)
    return out


def ggufs(cache: Path, model: str, source: Path, convert: Path, llama: Path, tools: Path, formats: list[str]) -> None:
    """CACHE/gguf/MODEL-TYPE.gguf for bf16 (the converter) and each format asked for (llama-quantize)."""
    directory = cache / "gguf"
    directory.mkdir(exist_ok=True)
    bf16 = directory / f"{model}-bf16.gguf"
    if not bf16.is_file() or bf16.stat().st_size == 0:
        log(f"converting {model} to a bf16 GGUF")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(convert), str(llama / "gguf-py")])}
        run([sys.executable, str(convert / "convert_hf_to_gguf.py"), str(source), "--outtype", "bf16",
             "--outfile", str(bf16) + ".tmp"], cache / f"convert_{model}.log", env=env)
        os.replace(str(bf16) + ".tmp", bf16)
    for label in formats:
        kind = FORMATS[label][0]
        target = directory / f"{model}-{kind}.gguf"
        if kind != "bf16" and (not target.is_file() or target.stat().st_size == 0):
            log(f"llama-quantize {model} {kind.upper()}")
            run([str(tools / "llama-quantize"), str(bf16), str(target) + ".tmp", kind.upper(), "2"],
                cache / f"quantize_{model}-{kind}.log")
            os.replace(str(target) + ".tmp", target)


# --- 4. the machine -------------------------------------------------------------------------------------------
def busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy (all cores; /proc/stat)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return sum(int(fields[i]) for i in (1, 2, 3, 6, 7)) / os.sysconf("SC_CLK_TCK")


def load_average() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def wait_quiet(threads: int, limit_s: float) -> float:
    """Wait (at most limit_s) until the other processes use fewer than cores − threads + 0.25 cores over 2 s;
    the cores they used last."""
    quiet = (os.cpu_count() or 1) - threads + 0.25
    waited = 0.0
    while True:
        before = busy_seconds()
        time.sleep(2 if limit_s > 0 else 0.2)
        used = (busy_seconds() - before) / (2 if limit_s > 0 else 0.2)
        if used < quiet or waited >= limit_s:
            return used
        waited += 2


def bandwidth() -> dict:
    """Copy bandwidth (numpy, 1 GiB, best of 5; read + write counted), one thread and two."""
    import threading

    import numpy as np

    n = (1 << 30) // 8
    a, b = np.ones(n), np.zeros(n)

    def best(f, times=5):
        out = []
        for _ in range(times):
            start = time.perf_counter()
            f()
            out.append(time.perf_counter() - start)
        return min(out)

    def two():
        h = n // 2
        ts = [threading.Thread(target=np.copyto, args=(b[i * h:(i + 1) * h], a[i * h:(i + 1) * h])) for i in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    gb = 2 * (1 << 30) / 1e9
    one, both = gb / best(lambda: np.copyto(b, a)), gb / best(two)
    return {"copy_1thread_GBps": one, "copy_2threads_GBps": both, "GBps": max(one, both)}


# --- 5. the runs ----------------------------------------------------------------------------------------------
def run(cmd: list[str], log_file: Path, env: dict | None = None) -> None:
    """A preparation step; its output to log_file; a failure is one line naming the log."""
    with open(log_file, "w") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        die(f"{Path(cmd[0]).name} {' '.join(cmd[1:3])} … failed (exit {done.returncode}), see {log_file}")


def timed(name: str, cmd: list[str], stem: Path, threads: int, run_wait: float, env: dict) -> bool:
    """One measured run: stdout to STEM.json, stderr to STEM.err, and STEM.cpu: its wall time, its own CPU time, the
    machine's busy CPU time meanwhile, and the other processes' cores before it started."""
    import resource

    others = wait_quiet(threads, run_wait)
    busy0, child0 = busy_seconds(), resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    with open(f"{stem}.json", "w") as out, open(f"{stem}.err", "w") as err:
        code = subprocess.run(cmd, stdout=out, stderr=err, env=env).returncode
    wall = time.perf_counter() - start
    child = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (child.ru_utime - child0.ru_utime) + (child.ru_stime - child0.ru_stime)
    Path(f"{stem}.cpu").write_text(f"{wall:.3f} {cpu:.3f} {busy_seconds() - busy0:.3f} {others:.2f}\n")
    if code != 0:
        tail = Path(f"{stem}.err").read_text(errors="replace")[-400:].strip().splitlines()[-2:]
        log(f"{name} {stem.name} failed: {' '.join(tail)}")
    return code == 0


def measure(args, cache: Path, tools: Path, out: Path) -> None:
    """The interleaved rounds, raw output to `out`."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    env = {**os.environ, "XDG_CONFIG_HOME": str(cache / "xdg" / "config"), "XDG_CACHE_HOME": str(cache / "xdg" / "cache"),
           "OMP_NUM_THREADS": str(args.threads)}
    fmoe = [sys.executable, "-m", "fmoe_cli.cli", "bench"]
    prompt = cache / "prompt64.txt"
    prompt.write_text(PROMPT)
    for model in args.models:  # fmoe's int8 / int4 stores are made on a first load: not measured
        for label in args.formats:
            options = FORMATS[label][2]
            if label in ("q8", "q4"):
                done = subprocess.run([*fmoe, str(cache / "models" / model), "--policy", "resident", "--tokens", "2",
                                       "--warmup", "1", *options, "--json"], env=env, capture_output=True, text=True)
                if done.returncode != 0:
                    die(f"fmoe bench {model} {' '.join(options)} failed: {done.stderr.strip().splitlines()[-1:]}")
    steps = [(r, m, label) for r in range(1, args.rounds + 1) for m in args.models for label in args.formats]
    runs = sum(1 + (FORMATS[label][2] is not None) for _, _, label in steps)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("measuring", total=runs)
        for r, model, label in steps:
            kind, _, options = FORMATS[label]
            with open(out / "load.log", "a") as f:
                f.write(f"r{r} {model}-{label} load {load_average()}\n")
            progress.update(task, description=f"round {r} {model}-{label} llama.cpp")
            timed("llama-bench", [str(tools / "llama-bench"), "-m", str(cache / "gguf" / f"{model}-{kind}.gguf"), "-p", "64", "-n",
                   str(args.tokens), "-t", str(args.threads), "-r", "3", "-o", "json"],
                  out / f"llama_{model}-{label}_r{r}", args.threads, args.run_wait, env)
            progress.advance(task)
            if options is not None:
                progress.update(task, description=f"round {r} {model}-{label} fmoe")
                timed("fmoe bench", [*fmoe, str(cache / "models" / model), "--policy", "resident", "--tokens", str(args.tokens),
                       "--prompt-file", str(prompt), *options, "--json"],
                      out / f"fmoe_{model}-{label}_r{r}", args.threads, args.run_wait, env)
                progress.advance(task)


# --- 6. the summary -------------------------------------------------------------------------------------------
def config_of(cache: Path, model: str) -> dict:
    return json.loads((cache / "models" / model / "config.json").read_text())


def gguf_bytes(path: Path, config: dict) -> float:
    """Weight bytes one decode token reads in llama.cpp: every non-expert tensor (the LM head included), one row of
    the token embedding, and top-k ÷ E of each stacked expert tensor."""
    import gguf

    k, experts = config["num_experts_per_tok"], config.get("num_experts", config.get("num_local_experts"))
    total = 0.0
    for t in gguf.GGUFReader(str(path)).tensors:
        n = int(t.n_bytes)
        total += n * k / experts if "_exps" in t.name else n / config["vocab_size"] if t.name == "token_embd.weight" else n
    return total


def fmoe_bytes(config: dict, dtype_bytes: int, expert_bits: float, dense: str = "bf16") -> float:
    """The same reads in fmoe: routed experts in their store's format; the attention in --dense's format as the run
    reports it (bf16: the compute dtype; int8: 8 + 16/128 bits; int4: 4 + 16/64), the LM head likewise (int8 beside
    int4 attention); norms, router and one embedding row in the compute dtype."""
    h, vocab, layers = config["hidden_size"], config["vocab_size"], config["num_hidden_layers"]
    head_dim, heads, kv_heads = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    experts, k = config.get("num_experts", config.get("num_local_experts")), config["num_experts_per_tok"]
    width = config["moe_intermediate_size"]
    dense_bits = {"int8": 8 + 16 / 128, "int4": 4 + 16 / 64}.get(dense, dtype_bytes * 8)
    head_bits = 8 + 16 / 128 if dense == "int4" else dense_bits
    attention = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2
    small = layers * (2 * head_dim + 2 * h + experts * h) + h + h
    routed = layers * k * 3 * h * width
    return (layers * attention * dense_bits + vocab * h * head_bits) / 8 + small * dtype_bytes + routed * expert_bits / 8


def others_share(stem: Path) -> float | None:
    """The share of the machine's cores that other processes used while this run ran; None when not timed."""
    try:
        wall, cpu, busy, _ = (float(x) for x in Path(f"{stem}.cpu").read_text().split())
    except (OSError, ValueError):
        return None
    return max(0.0, busy - cpu) / (wall * (os.cpu_count() or 1)) if wall > 0 else None


def read_json(path: Path):
    try:
        if path.stat().st_size > 16 << 20:
            return None
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def summarise(args, cache: Path, out: Path, bytes_per_s: float) -> list[dict]:
    """One row per cell: medians over the clean rounds (the other processes left the run its cores); the bandwidth
    floor of a token, ms, is its bytes at the copy bandwidth."""
    clean_below = max(0.10, ((os.cpu_count() or 1) - args.threads - 0.15) / (os.cpu_count() or 1))

    def pick(samples):
        clean = [v for v, o in samples if o is not None and o < clean_below]
        return (clean, len(clean)) if clean else ([v for v, _ in samples], 0)

    def median(xs):
        return statistics.median(xs) if xs else None

    rows = []
    for model in args.models:
        config = config_of(cache, model)
        for label in args.formats:
            llama_tpot, llama_pp, fmoe_tpot, fmoe_pp, dense = [], [], [], [], "bf16"
            for r in range(1, args.rounds + 1):
                stem = out / f"llama_{model}-{label}_r{r}"
                share = others_share(stem)
                for t in read_json(Path(f"{stem}.json")) or []:
                    if t.get("n_gen", 0) > 0:
                        llama_tpot.append((t["avg_ns"] / t["n_gen"] / 1e6, share))
                    if t.get("n_prompt", 0) > 0:
                        llama_pp.append((t["avg_ts"], share))
                stem = out / f"fmoe_{model}-{label}_r{r}"
                report = read_json(Path(f"{stem}.json"))
                if report and report.get("runs"):
                    share, first = others_share(stem), report["runs"][0]
                    dense = report.get("dense") or "bf16"
                    fmoe_tpot.append((first["tpot_ms"]["median"], share))
                    fmoe_pp.append((report["prompt_tokens"] / (first["ttft_ms"] / 1000), share))
            if not llama_tpot and not fmoe_tpot:
                continue
            (lt, lt_clean), (ft, ft_clean) = pick(llama_tpot), pick(fmoe_tpot)
            lb = gguf_bytes(cache / "gguf" / f"{model}-{FORMATS[label][0]}.gguf", config)
            fb = fmoe_bytes(config, *FMOE_BITS[label], dense) if label in FMOE_BITS else None
            row = {"model": model, "fmt": label, "llama_tpot": median(lt), "fmoe_tpot": median(ft),
                   "llama_clean": f"{lt_clean}/{len(llama_tpot)}", "fmoe_clean": f"{ft_clean}/{len(fmoe_tpot)}",
                   "llama_tpot_all": llama_tpot, "fmoe_tpot_all": fmoe_tpot,
                   "llama_pp": median(pick(llama_pp)[0]), "fmoe_pp": median(pick(fmoe_pp)[0]),
                   "llama_bytes": lb, "fmoe_bytes": fb, "llama_floor": lb / bytes_per_s * 1e3,
                   "fmoe_floor": fb / bytes_per_s * 1e3 if fb else None}
            row["decode_ratio"] = (row["fmoe_tpot"] / row["llama_tpot"]
                                   if row["fmoe_tpot"] and row["llama_tpot"] else None)
            row["prefill_ratio"] = row["fmoe_pp"] / row["llama_pp"] if row["fmoe_pp"] and row["llama_pp"] else None
            rows.append(row)
    return rows


def cell_line(row: dict) -> str:
    """The one summary line of a cell."""
    def f(x, n=2):
        return "-" if x is None else f"{x:.{n}f}"

    return (f"{row['model']}-{row['fmt']}: decode fmoe {f(row['fmoe_tpot'])} ms, llama.cpp {f(row['llama_tpot'])} ms, "
            f"fmoe ÷ llama.cpp {f(row['decode_ratio'])}; prefill fmoe {f(row['fmoe_pp'], 0)} tok/s, llama.cpp "
            f"{f(row['llama_pp'], 0)} tok/s, fmoe ÷ llama.cpp {f(row['prefill_ratio'])}; clean rounds "
            f"{row['fmoe_clean']} / {row['llama_clean']}")


def print_table(rows: list[dict], summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    def f(x, n=1):
        return "-" if x is None else f"{x:.{n}f}"

    console = Console(stderr=True, width=200)
    console.print(f"llama.cpp {summary['llama_version']} (commit {summary['llama_commit']}); threads "
                  f"{summary['threads']}; copy bandwidth {summary['bandwidth_GBps']:.1f} GB/s; load average "
                  f"{summary['load_start']} → {summary['load_end']}; {summary['rounds']} round(s) of "
                  f"{summary['tokens']} tokens", highlight=False)
    table = Table(title="decode TPOT (median of the clean rounds), bytes a token reads, share of the bandwidth floor, "
                        "prefill of 64 tokens")
    for col in ("cell", "llama.cpp ms", "fmoe ms", "fmoe ÷ llama", "llama MB", "fmoe MB", "llama % floor",
                "fmoe % floor", "llama pp tok/s", "fmoe pp tok/s", "clean L / F"):
        table.add_column(col, justify="left" if col == "cell" else "right")
    for r in rows:
        table.add_row(f"{r['model']}-{r['fmt']}", f(r["llama_tpot"], 2), f(r["fmoe_tpot"], 2), f(r["decode_ratio"], 2),
                      f(r["llama_bytes"] / 1e6), f(r["fmoe_bytes"] / 1e6 if r["fmoe_bytes"] else None),
                      f(r["llama_floor"] / r["llama_tpot"] * 100 if r["llama_tpot"] else None, 0),
                      f(r["fmoe_floor"] / r["fmoe_tpot"] * 100 if r["fmoe_tpot"] and r["fmoe_floor"] else None, 0),
                      f(r["llama_pp"], 0), f(r["fmoe_pp"], 0), f"{r['llama_clean']} / {r['fmoe_clean']}")
    console.print(table)


# --- the command ----------------------------------------------------------------------------------------------
def disk_needed(cache: Path, models: list[str], formats: list[str]) -> float:
    """GB the missing checkpoints, GGUFs and fmoe stores will take."""
    need = 0.0
    for model in models:
        missing = not (cache / "models" / model / "model.safetensors").is_file()
        need += BF16_GB[model] if missing else 0.0
        for kind, ratio in [("bf16", 1.0)] + [FORMATS[label][:2] for label in formats if FORMATS[label][0] != "bf16"]:
            if not (cache / "gguf" / f"{model}-{kind}.gguf").is_file():
                missing = True
                need += BF16_GB[model] * ratio
        need += 0.75 * BF16_GB[model] if missing else 0.0  # fmoe's int8 + int4 expert stores
    return need


def parser() -> argparse.ArgumentParser:
    def positive(text: str) -> int:
        value = int(text)
        if value < 1:
            raise argparse.ArgumentTypeError(f"{text}: at least 1")
        return value

    def names(allowed):
        def parse(text: str) -> list[str]:
            items = [x.strip() for x in text.replace(",", " ").split() if x.strip()]
            bad = [x for x in items if x not in allowed]
            if bad or not items:
                raise argparse.ArgumentTypeError(f"{','.join(bad) or text!r}: not one of {', '.join(allowed)}")
            return list(dict.fromkeys(items))
        return parse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=names(MODELS), default=None,
                   help=f"comma-separated, of {', '.join(MODELS)} (default: all three)")
    p.add_argument("--formats", type=names(tuple(FORMATS)), default=None,
                   help=f"comma-separated, of {', '.join(FORMATS)} (default: all; f16 is llama.cpp's only)")
    p.add_argument("--rounds", type=positive, default=None, help="interleaved rounds (default 3)")
    p.add_argument("--tokens", type=positive, default=None, help="decode tokens a run (default 64)")
    p.add_argument("--threads", type=positive, default=2, help="threads of both tools (default 2)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: demo, f32 and q4, 1 round of 16 tokens, no waiting for a quiet machine "
                        "(the options given beside it win)")
    p.add_argument("--max-wait", type=float, default=None, help="s to wait for a load average under 0.6 (default 600)")
    p.add_argument("--run-wait", type=float, default=None,
                   help="s each run waits for the other processes to leave it its cores (default 120)")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="the build, checkpoints, GGUFs and results (default: $XDG_CACHE_HOME/fmoe-peer)")
    p.add_argument("--json", action="store_true", help="the summary as one JSON object on stdout")
    return p


def options(argv: list[str] | None = None) -> argparse.Namespace:
    args = parser().parse_args(argv)
    defaults = {"models": list(MODELS), "formats": list(FORMATS), "rounds": 3, "tokens": 64, "max_wait": 600,
                "run_wait": 120}
    for key, value in (QUICK if args.quick else defaults).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key, value in defaults.items():  # --quick names only some
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.cache_dir = (args.cache_dir or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                      / "fmoe-peer").expanduser().resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = options(argv)
    if not Path("/proc/stat").is_file():
        die("needs Linux (/proc/stat)")
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            die(f"{tool} not found (needed to build llama.cpp)")
    cache = args.cache_dir
    cache.mkdir(parents=True, exist_ok=True)
    import fcntl

    lock = open(cache / ".lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        die(f"another run holds {cache / '.lock'}")
    for stale in (cache / "gguf").glob("*.tmp"):  # left by an interrupted conversion
        stale.unlink()
    need, free = disk_needed(cache, args.models, args.formats), shutil.disk_usage(cache).free / 1e9
    if need + 1 > free:
        die(f"{cache} needs ~{need:.1f} GB more for {','.join(args.models)} but has {free:.1f} GB free")
    log(f"cache {cache}: ~{need:.1f} GB to write, {free:.1f} GB free")

    llama = llama_source(cache)
    flags = CMAKE_FLAGS + cpu_flags(Path("/proc/cpuinfo").read_text())
    tools = build_llama(cache, llama, flags)
    version, commit = llama_version(tools, llama)
    convert = converter(cache, llama)
    for model in args.models:
        ggufs(cache, model, checkpoint(cache, model), convert, llama, tools, args.formats)

    waited = 0.0
    while float(load_average().split()[0]) > QUIET_LOAD and waited < args.max_wait:
        log(f"load {load_average()} > {QUIET_LOAD}, waiting ({waited:.0f} s)")
        time.sleep(30)
        waited += 30
    load_start = load_average()
    wait_quiet(args.threads, args.run_wait)
    copy = bandwidth()
    log(f"copy bandwidth {copy['GBps']:.1f} GB/s; load average {load_start}")
    out = cache / "results" / time.strftime("run-%Y%m%d-%H%M%S")
    out.mkdir(parents=True)
    (out / "bandwidth.json").write_text(json.dumps(copy) + "\n")
    measure(args, cache, tools, out)

    sys.path.insert(0, str(llama / "gguf-py"))
    rows = summarise(args, cache, out, copy["GBps"] * 1e9)
    summary = {"rows": rows, "bandwidth_GBps": copy["GBps"], "load_start": load_start, "load_end": load_average(),
               "threads": args.threads, "rounds": args.rounds, "tokens": args.tokens, "llama_version": version,
               "llama_commit": commit, "cmake_flags": " ".join(flags), "results": str(out)}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print_table(rows, summary)
    if args.json:
        print(json.dumps(summary))
    else:
        for row in rows:
            print(cell_line(row))
    log(f"raw results and summary.json: {out}")
    return 0 if rows else 1


if __name__ == "__main__":
    raise SystemExit(main())
