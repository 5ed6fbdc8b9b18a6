"""`fmoe serve`'s memory under a burst of oversized prompts, with and without what bounds it.

Each setting runs a server of its own (a child process: the demo model on the CPU, the app on a real
uvicorn on a loopback port, as `fmoe serve` builds it); this process sends the burst, three 2 MB
prompts at a time, `--rounds` times, to /v1/completions, and reads the server's RSS before, during
(sampled every 5 ms: the peak) and after.

The demo's context (1024 tokens) refuses a 2 MB prompt by its characters before tokenising it (the
first setting). The others remove that bound, as for a model whose context times its longest token
exceeds 2 MB (a 128k-token context would): the prompt is tokenised (~500k tokens) and then refused
by its tokens, and the allocator settings decide what memory stays behind.

    python benchmarks/serve_memory.py                   # every setting, 3 rounds
    python benchmarks/serve_memory.py --rounds 5 --json
"""

from __future__ import annotations

import argparse
import http.client
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

# name: (refuse by characters, malloc arenas (None: glibc's default), malloc_trim after a large body,
#        threads that read and tokenise bodies)
SETTINGS = {
    "fmoe serve": (True, 2, True, 1),
    "tokenised": (False, 2, True, 1),
    "tokenised, 1 arena": (False, 1, True, 1),
    "tokenised, no trim": (False, 2, False, 1),
    "tokenised, glibc default arenas, no trim": (False, None, False, 1),
    "tokenised as before (3 threads, glibc defaults)": (False, None, False, 3),
}
PROMPT = "and " * 500_000  # 2 MB, about 500k tokens of the demo's tokenizer
MIB = 1024**2


def serve(name: str) -> None:
    """The child: one setting's server; prints its port, serves until killed."""
    by_characters, arenas, trim, threads = SETTINGS[name]
    from fmoe_cli.serve import ServeOptions, limit_malloc_arenas

    if arenas is not None:
        limit_malloc_arenas(arenas)  # before torch's threads, as `fmoe serve` does
    import io
    from concurrent.futures import ThreadPoolExecutor as Pool

    from rich.console import Console

    import fmoe_cli.serve.app as app
    from fmoe_cli.chat import ChatOptions
    from fmoe_cli.chat.repl import open_chat
    from fmoe_cli.options import RunOptions

    chat = open_chat(ChatOptions(RunOptions(model="demo", device="cpu", policies=("lru",))),
                     Console(file=io.StringIO()))
    service = app.start_service(chat.session, "demo", ServeOptions(port=0), chat.idle)
    if not by_characters:
        service.longest_token = None
    if not trim:
        app.return_freed_memory = lambda: None
    if threads != 1:
        service.preparing = Pool(threads)
    sock = service.options.bind()
    print(sock.getsockname()[1], flush=True)
    app.serve_in(service, sock, log_level="error").run(sockets=[sock])


def rss(pid: int) -> int:
    import psutil

    return psutil.Process(pid).memory_info().rss


def post(port: int, body: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/completions", body)
    status = conn.getresponse().status
    conn.close()
    return status


def measure(name: str, rounds: int) -> dict:
    child = subprocess.Popen([sys.executable, __file__, "--serve", name], stdout=subprocess.PIPE, text=True)
    try:
        port = int(child.stdout.readline())
        post(port, json.dumps({"prompt": "In the beginning", "max_tokens": 4}))
        before = peak = rss(child.pid)
        after_rounds, statuses, body = [], set(), json.dumps({"prompt": PROMPT})
        start = time.perf_counter()
        with ThreadPoolExecutor(3) as pool:
            for _ in range(rounds):
                replies = [pool.submit(post, port, body) for _ in range(3)]
                while not all(r.done() for r in replies):
                    peak = max(peak, rss(child.pid))
                    time.sleep(0.005)
                statuses |= {r.result() for r in replies}
                after_rounds.append(rss(child.pid) / MIB)
        seconds = time.perf_counter() - start
        time.sleep(1)
        after = rss(child.pid)
        return {"setting": name, "before_mib": before / MIB, "peak_mib": peak / MIB, "after_rounds_mib": after_rounds,
                "after_mib": after / MIB, "growth_mib": (after - before) / MIB, "seconds": seconds,
                "statuses": sorted(statuses)}
    finally:
        child.kill()
        child.wait()


def render(rows: list[dict]) -> str:
    lines = ["| setting | RSS before (MiB) | peak | after each round | after | growth | burst (s) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        rounds = " / ".join(f"{v:.0f}" for v in r["after_rounds_mib"])
        lines.append(f"| {r['setting']} | {r['before_mib']:.0f} | {r['peak_mib']:.0f} | {rounds} | {r['after_mib']:.0f} "
                     f"| {r['growth_mib']:+.0f} | {r['seconds']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="bursts of three 2 MB prompts")
    parser.add_argument("--settings", nargs="*", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--serve", choices=list(SETTINGS), help=argparse.SUPPRESS)  # the child
    args = parser.parse_args()
    if args.serve:
        return serve(args.serve)
    rows = []
    for name in args.settings:
        rows.append(measure(name, args.rounds))
        if not args.json:
            print(render(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    print(json.dumps(rows) if args.json else render(rows))


if __name__ == "__main__":
    main()
