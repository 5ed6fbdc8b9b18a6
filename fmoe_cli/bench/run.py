"""`fmoe bench`: TTFT/TPOT and the engine's counters, for one or more policies in one process."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

import psutil
import torch
from rich.console import Console
from rich.table import Table

from fmoe_cli.errors import FmoeError
from fmoe_cli.generate import SamplingParams, stream_generate
from fmoe_cli.models.load import LoadedModel
from fmoe_cli.offload.engine import Counters, Engine, EngineSettings
from fmoe_cli.offload.link import CudaLink, EmulatedLink, ThreadLink

DEFAULT_PROMPT = "Explain in a few sentences how a mixture-of-experts model decides which experts to use."
MiB = 1024**2


@dataclass
class RunResult:
    policy: str
    ttft_ms: float
    tpot_ms: dict  # {"median", "p90"}
    tokens_per_s: float
    hit_rate: float
    prefetch_precision: float
    prefetch_recall: float
    exposed_load_ms_per_token: float
    bytes_per_token: float
    peak_device_bytes: int
    plan: str
    token_ids: list[int]


def make_link(device: torch.device, emulate_gbps: float | None):
    if emulate_gbps is not None:
        if emulate_gbps <= 0:
            raise FmoeError(f"--emulate-link takes a bandwidth in GB/s > 0, got {emulate_gbps}")
        return EmulatedLink(emulate_gbps)
    if device.type == "cuda":
        return CudaLink(device)
    return ThreadLink()  # the CPU is its own device: a plain host copy


def link_info(link) -> dict:
    return {"kind": link.kind, "gbps": link.gbps, "label": link.label()}


def encode_prompt(lm: LoadedModel, prompt: str) -> torch.Tensor:
    tok = lm.tokenizer
    if tok is None:
        raise FmoeError(f"{lm.model_id} has no tokenizer; fmoe needs one to encode the prompt")
    if getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_dict=False)
    else:
        ids = tok(prompt)["input_ids"]
    return torch.tensor([ids])


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def bench_policy(lm: LoadedModel, engine: Engine, settings: EngineSettings, prompt_ids: torch.Tensor,
                 tokens: int, warmup: int = 0) -> RunResult:
    """Configure the engine for one policy, warm it up on the prompt, then measure `tokens` tokens (greedy)."""
    engine.configure(settings)
    if warmup:
        for _ in stream_generate(lm.model, prompt_ids, engine=engine, max_new_tokens=warmup, stop_on_eos=False):
            pass
    if lm.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(lm.device)
    events = list(stream_generate(lm.model, prompt_ids, engine=engine, max_new_tokens=tokens, stop_on_eos=False,
                                  sampling=SamplingParams()))
    decode = events[1:] or events
    steady = sum((e.counters for e in decode), Counters())
    tpot = [e.latency_s * 1000 for e in decode]
    if lm.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(lm.device)
    else:  # the CPU has no device memory of its own: what the engine places "on the device"
        peak = lm.non_expert_bytes + engine.device_bytes()
    n = len(decode)
    return RunResult(
        policy=settings.policy,
        ttft_ms=events[0].latency_s * 1000,
        tpot_ms={"median": statistics.median(tpot), "p90": percentile(tpot, 0.9)},
        tokens_per_s=1000 / statistics.mean(tpot),
        hit_rate=steady.hit_rate,
        prefetch_precision=steady.prefetch_precision,
        prefetch_recall=steady.prefetch_recall,
        exposed_load_ms_per_token=steady.exposed_s * 1000 / n,
        bytes_per_token=steady.bytes_moved / n,
        peak_device_bytes=peak,
        plan=settings.plan.summary(),
        token_ids=[e.token_id for e in events],
    )


def bench_report(lm: LoadedModel, link, budget_bytes: int, runs: list[RunResult]) -> dict:
    return {
        "model": lm.model_id,
        "label": lm.label,
        "device": str(lm.device),
        "dtype": str(lm.dtype).removeprefix("torch."),
        "link": {"kind": link.kind, "gbps": link.gbps},
        "vram_budget_bytes": budget_bytes,
        "peak_rss_bytes": psutil.Process().memory_info().rss,
        "runs": [asdict(r) for r in runs],
    }


def render(report: dict, link_label: str, console: Console) -> None:
    runs = report["runs"]
    first = runs[0]["tpot_ms"]["median"]
    table = Table(title=f"{report['label']} · {report['device']} · {link_label} · "
                        f"expert budget {report['vram_budget_bytes'] / MiB:.1f} MiB")
    for col in ("policy", "TTFT ms", "TPOT ms (med / p90)", "tok/s", "hit rate", "prefetch P / R",
                "exposed ms/tok", "MiB/tok", "device MiB", f"TPOT ÷ {runs[0]['policy']}"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in runs:
        table.add_row(
            r["policy"], f"{r['ttft_ms']:.1f}", f"{r['tpot_ms']['median']:.1f} / {r['tpot_ms']['p90']:.1f}",
            f"{r['tokens_per_s']:.1f}", f"{r['hit_rate']:.2f}",
            f"{r['prefetch_precision']:.2f} / {r['prefetch_recall']:.2f}",
            f"{r['exposed_load_ms_per_token']:.2f}", f"{r['bytes_per_token'] / MiB:.2f}",
            f"{r['peak_device_bytes'] / MiB:.1f}", f"{r['tpot_ms']['median'] / first:.2f}",
        )
    console.print(table)
    ids = {tuple(r["token_ids"]) for r in runs}
    console.print("token ids identical across policies" if len(ids) == 1 else
                  "[red]token ids DIFFER across policies[/red]")
