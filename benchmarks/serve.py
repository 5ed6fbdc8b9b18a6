"""`fmoe serve` against the engine in-process, on one loaded model (docs/serve.md has the table).

Measures, in one run, on a real uvicorn on a loopback port, clients in processes of their own:

1. TPOT through the server (SSE chunks as the client receives them) against `stream_generate`
   in-process (the session's answer loop, events as the consumer receives them), same prompt,
   same token count, rounds interleaved: the HTTP overhead.
2. TTFT p50 / p95 with 1, 2 and 4 concurrent clients (each sends its requests one after
   another; requests queue, so TTFT grows with the clients ahead).
3. Second-turn TTFT of a conversation sent again with its answer: right after the first turn
   (the KV cache is reused: `cached_tokens`) against after another conversation came between
   (only the chat template's first tokens are in common), rounds interleaved.

    python benchmarks/serve.py                       # the demo model, 5 rounds
    python benchmarks/serve.py --model demo --rounds 9 --tokens 64 --json
"""

from __future__ import annotations

import argparse
import http.client
import io
import json
import multiprocessing
import statistics
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import openai

# The clients run in processes of their own (as real clients do): the openai client's work per
# chunk is not charged to the server through the GIL. They import this module: fmoe is imported
# only where the server and the in-process runs need it.

PROMPTS = ["In the beginning", "The LORD is my shepherd", "Thou shalt not", "Behold, I stand at the door",
           "And God said", "Blessed are the meek", "The heavens declare the glory of God", "Honour thy father"]
SYSTEM = ("You are a scribe. " * 40).strip()  # a long first prompt: what a reused KV cache saves


def spread(values: list[float]) -> dict:
    """Median and the spread over repeats (min, max)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def tpot(times: list[float]) -> float:
    """Seconds per token between the first and the last token's arrival."""
    return (times[-1] - times[0]) / (len(times) - 1)


def served(url: str, model: str, messages, tokens: int) -> tuple[float, list[float], dict]:
    """(TTFT s, arrival times of the tokens with text, usage) of one streamed request (in a client process).
    A raw HTTP client that only looks for the content in each line: on a 2-core machine the client's own
    work per chunk competes with the engine for the cores, and a parsing client (the openai one) would
    be measured as the server's overhead."""
    host, port = url.split("//")[1].split("/")[0].split(":")
    body = json.dumps({"model": model, "messages": messages, "max_tokens": tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection(host, int(port))
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    times, usage = [], None
    for line in conn.getresponse():
        if line.startswith(b'data: {"id"'):
            if b'"delta": {"content": "' in line:
                times.append(time.perf_counter())
            elif b'"usage": {' in line:
                usage = json.loads(line[6:])["usage"]
    conn.close()
    return times[0] - start, times, usage


def answer(url: str, model: str, messages, tokens: int) -> str:
    return openai.OpenAI(base_url=url, api_key="none", max_retries=0).chat.completions.create(
        model=model, messages=messages, max_tokens=tokens, temperature=0).choices[0].message.content


def client_run(url: str, model: str, conversations, tokens: int) -> list[tuple[float, list[float], dict]]:
    """One client: its requests one after another."""
    return [served(url, model, messages, tokens) for messages in conversations]


class Bench:
    def __init__(self, model: str, policy: str | None, emulate_link: float | None) -> None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from rich.console import Console

        from fmoe_cli.chat import ChatOptions
        from fmoe_cli.chat.repl import open_chat
        from fmoe_cli.options import RunOptions
        from fmoe_cli.serve import ServeOptions
        from fmoe_cli.serve.app import serve_in, start_service

        run = RunOptions(model=model, device="cpu", emulate_link=emulate_link,
                         **({"policies": (policy,)} if policy else {}))
        self.chat = open_chat(ChatOptions(run), Console(file=io.StringIO()))
        self.session = self.chat.session
        # No idle hook: re-planning stays out of the measurements (and never races the in-process runs);
        # it runs once, by hand, after the warm-up.
        self.service = start_service(self.session, model, ServeOptions(port=0, max_queue=64))
        self.sock = ServeOptions(port=0).bind()
        self.server = serve_in(self.service, self.sock, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        self.model = model
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"

        self.pool = ProcessPoolExecutor(4, mp_context=multiprocessing.get_context("spawn"))

    def served(self, messages, tokens: int) -> tuple[float, list[float], dict]:
        return self.pool.submit(served, self.url, self.model, messages, tokens).result()

    def clients(self, conversations_per_client: list, tokens: int) -> list:
        futures = [self.pool.submit(client_run, self.url, self.model, c, tokens) for c in conversations_per_client]
        return [r for f in futures for r in f.result()]

    def in_process(self, messages, tokens: int) -> list[float]:
        from fmoe_cli.generate import SamplingParams, encode_messages

        ids = encode_messages(self.session.lm.tokenizer, messages, self.model)
        times, steps = [], []
        for event in self.session.generate(ids, tokens, SamplingParams()):
            steps.append(event.latency_s)
            if event.text:
                times.append(time.perf_counter())
        self.in_process_step = statistics.mean(steps[1:])
        return times

    def close(self) -> None:
        self.pool.shutdown()
        self.server.should_exit = True
        self.thread.join()
        self.service.worker.close(cancel_current=True)
        self.service.worker.join()
        self.sock.close()
        self.chat.close()


def run(args) -> dict:
    bench = Bench(args.model, args.policy, args.emulate_link)
    try:
        bench.clients([[[{"role": "user", "content": p}]] for p in PROMPTS[:4]], 8)  # warm-up: the client processes too
        for p in PROMPTS[:2]:  # warm-up: first forwards, the first re-plan
            bench.served([{"role": "user", "content": p}], 8)
        bench.chat.idle()  # the server is idle: save the statistics, re-plan if due
        # 1. TPOT: server vs in-process, interleaved, alternating which goes first. Also, per request
        #    through the server, the engine's own decode steps (its TokenEvents): client TPOT / step - 1 is
        #    the HTTP overhead on the same tokens, which the machine's noise between runs does not blur.
        steps: list[float] = []
        observe = bench.service.metrics.observe

        def recording(job, events, cached):
            steps.append(statistics.mean(e.latency_s for e in events[1:]) if len(events) > 1 else float("nan"))
            observe(job, events, cached)

        bench.service.metrics.observe = recording
        tpots = {"server": [], "in_process": []}
        overhead, engine_steps, loop_overhead = [], [], []
        for r in range(args.rounds):
            messages = [{"role": "user", "content": PROMPTS[r % len(PROMPTS)]}]
            order = ("server", "in_process") if r % 2 == 0 else ("in_process", "server")
            for which in order:
                if which == "server":
                    times = bench.served(messages, args.tokens)[1]
                    overhead.append(tpot(times) / steps[-1] - 1)
                    engine_steps.append(steps[-1] * 1000)
                else:
                    times = bench.in_process(messages, args.tokens)
                    loop_overhead.append(tpot(times) / bench.in_process_step - 1)
                tpots[which].append(tpot(times) * 1000)
        ratio = [s / i for s, i in zip(tpots["server"], tpots["in_process"])]
        extra = [s - i for s, i in zip(tpots["server"], tpots["in_process"])]
        # 2. TTFT with 1, 2, 4 concurrent clients
        concurrency = {}
        for clients in (1, 2, 4):
            conversations = [[[{"role": "user", "content": PROMPTS[(c + r) % len(PROMPTS)]}] for r in range(args.rounds)]
                             for c in range(clients)]
            ttfts = [r[0] * 1000 for r in bench.clients(conversations, args.short_tokens)]
            concurrency[clients] = {"p50_ms": percentile(ttfts, 0.5), "p95_ms": percentile(ttfts, 0.95),
                                    "requests": len(ttfts)}
        # 3. second-turn TTFT with and without prompt reuse, interleaved
        turns = {"reuse": [], "no_reuse": []}
        cached = {"reuse": [], "no_reuse": []}
        for r in range(args.rounds):
            first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPTS[r % len(PROMPTS)]}]
            for which in (("reuse", "no_reuse") if r % 2 == 0 else ("no_reuse", "reuse")):
                reply = answer(bench.url, bench.model, first, args.short_tokens)
                if which == "no_reuse":  # another conversation between the turns
                    bench.served([{"role": "user", "content": PROMPTS[(r + 3) % len(PROMPTS)]}], 2)
                second = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Go on."}]
                ttft, _, usage = bench.served(second, args.short_tokens)
                turns[which].append(ttft * 1000)
                cached[which].append(usage["prompt_tokens_details"]["cached_tokens"])
        prompt_tokens = usage["prompt_tokens"]
    finally:
        bench.close()
    return {
        "model": args.model, "tokens": args.tokens, "rounds": args.rounds, "threads": args.threads,
        "tpot_ms": {k: spread(v) for k, v in tpots.items()},
        "server_over_in_process": spread(ratio),
        "median_over_median": statistics.median(tpots["server"]) / statistics.median(tpots["in_process"]),
        "server_minus_in_process_ms": spread(extra),
        "server_engine_step_ms": spread(engine_steps),
        "http_overhead": spread(overhead),
        "loop_overhead_in_process": spread(loop_overhead),
        "ttft_by_clients": concurrency,
        "second_turn_ttft_ms": {k: spread(v) for k, v in turns.items()},
        "second_turn_cached_tokens": {k: statistics.median(v) for k, v in cached.items()},
        "second_turn_prompt_tokens": prompt_tokens,
    }


def render(report: dict) -> str:
    t, o, q, e = report["tpot_ms"], report["http_overhead"], report["server_over_in_process"], report["server_engine_step_ms"]
    lines = [f"model {report['model']}, {report['tokens']} tokens, {report['rounds']} rounds (median [min, max])", "",
             "| measure | value |", "|---|---|"]
    for k, name in (("in_process", "TPOT in-process (ms)"), ("server", "TPOT through the server (ms)")):
        lines.append(f"| {name} | {t[k]['median']:.2f} [{t[k]['min']:.2f}, {t[k]['max']:.2f}] |")
    lines.append(f"| TPOT server / in-process (pairs of adjacent runs) | {q['median']:.3f} [{q['min']:.3f}, {q['max']:.3f}] |")
    lines.append(f"| TPOT server / in-process (median ÷ median) | {report['median_over_median']:.3f} |")
    x = report["server_minus_in_process_ms"]
    lines.append(f"| TPOT server − in-process (ms per token) | {x['median']:+.2f} [{x['min']:+.2f}, {x['max']:+.2f}] |")
    lines.append(f"| engine decode step of the served requests (ms) | {e['median']:.2f} [{e['min']:.2f}, {e['max']:.2f}] |")
    lines.append(f"| through the server: client TPOT / the same request's engine step | {o['median'] * 100:+.1f} % "
                 f"[{o['min'] * 100:+.1f}, {o['max'] * 100:+.1f}] |")
    lo = report["loop_overhead_in_process"]
    lines.append(f"| in-process: consumer TPOT / the same run's engine step | {lo['median'] * 100:+.1f} % "
                 f"[{lo['min'] * 100:+.1f}, {lo['max'] * 100:+.1f}] |")
    for clients, c in report["ttft_by_clients"].items():
        lines.append(f"| TTFT, {clients} concurrent client{'s' if clients > 1 else ''} (ms) | p50 {c['p50_ms']:.1f}, "
                     f"p95 {c['p95_ms']:.1f} ({c['requests']} requests) |")
    s, c = report["second_turn_ttft_ms"], report["second_turn_cached_tokens"]
    for k, name in (("reuse", "with prompt reuse"), ("no_reuse", "without (another conversation between)")):
        lines.append(f"| second-turn TTFT {name} (ms) | {s[k]['median']:.1f} [{s[k]['min']:.1f}, {s[k]['max']:.1f}], "
                     f"{c[k]:.0f} of {report['second_turn_prompt_tokens']} prompt tokens cached |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--policy", default=None, help="a policy (default: fmoe's default)")
    parser.add_argument("--emulate-link", type=float, default=None, metavar="GBPS")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=48, help="tokens per TPOT measurement")
    parser.add_argument("--short-tokens", type=int, default=8, help="tokens per TTFT measurement")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    report = run(args)
    print(json.dumps(report, indent=2) if args.json else render(report))


if __name__ == "__main__":
    main()
