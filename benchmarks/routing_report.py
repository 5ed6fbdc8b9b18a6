#!/usr/bin/env python3
"""Routing report of an MoE checkpoint (default: fmoe's shipped demo model), beside a real Mixtral trace.

Per MoE layer i it prints

* the share of the layer's expert activations taken by its most-used expert
  (1/E when perfectly balanced);
* the consecutive-token expert overlap |A_t ∩ A_{t-1}| / K, averaged over
  consecutive token pairs of a text (A_t: the top-K experts of token t);
* the recall of the speculative next-layer prediction (MoEpic Eq. 3): layer
  i+1's router applied to layer i's router input h_i,
  top-K(softmax(R_{i+1}(h_i))), compared with layer i+1's actual top-K:
  |predicted ∩ actual| / K. (Softmax is monotonic, so top-K of the logits.)
  The row of layer i holds the prediction *for* layer i (made from layer i-1);
  layer 0 has none.

and the model's validation loss / perplexity on held-out text. The Mixtral
columns come from the real Mixtral-8x7B-Instruct routing trace (top-2 of 8; not
shipped: --trace or FMOE_MIXTRAL_TRACE, see benchmarks/mixtral_trace.py; without it
one line says so and the columns are left out): the most-used expert's share and
the consecutive-token overlap per layer (the trace has no hidden states, so no
prediction recall).

    python benchmarks/routing_report.py                      # shipped demo, held-out KJV chapters
    python benchmarks/routing_report.py --model DIR --text FILE --trace TRACE.jsonl

Needs: the default held-out text is the KJV as Debian's ``bible`` program prints it
(``apt-get install bible-kjv``, which pulls in ``bible-kjv-text``), split as
tools/train_demo.py split it; without it, give any text with ``--text FILE``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / "fmoe_cli" / "models" / "demo_model"
sys.path.insert(0, str(ROOT / "benchmarks"))
import mixtral_trace  # noqa: E402 (benchmarks/mixtral_trace.py)


# ------------------------------------------------------------------- the model
def held_out_text(model_dir: Path) -> tuple[str, str]:
    """The validation chapters of the training run (same split as tools/train_demo.py)."""
    import shutil

    if shutil.which("bible") is None:
        sys.exit("routing_report.py: the default held-out text needs Debian's `bible` program "
                 "(`apt-get install bible-kjv`, which pulls in bible-kjv-text); or give a text with --text FILE")
    sys.path.insert(0, str(ROOT / "tools"))
    import train_demo

    info_path = model_dir / "training_info.json"
    val_every = 40
    if info_path.exists():
        val_every = json.loads(info_path.read_text())["args"].get("val_every", 40)
    chapters, _, _ = train_demo.load_corpus(None)
    val = [c for i, c in enumerate(chapters) if i % val_every == val_every // 2]
    return "\n\n".join(train_demo.chapter_doc(t, v) for t, v in val), f"{len(val)} held-out KJV chapters"


@torch.no_grad()
def model_routing(model_dir: Path, text: str, seq_len: int, max_tokens: int) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    ids = tok(text, add_special_tokens=False, return_tensors="pt", truncation=False)["input_ids"][0]
    ids = ids[: max_tokens + 1]
    layers = model.model.layers
    gates = [layer.mlp.gate for layer in layers]
    k = model.config.num_experts_per_tok
    n_exp = model.config.num_experts

    router_in: dict[int, list[torch.Tensor]] = defaultdict(list)
    hooks = [
        g.register_forward_hook(lambda mod, args, out, i=i: router_in[i].append(args[0].reshape(-1, args[0].shape[-1])))
        for i, g in enumerate(gates)
    ]
    nll, count = 0.0, 0
    for s in range(0, len(ids) - 1, seq_len):
        chunk = ids[s : s + seq_len + 1]
        if len(chunk) < 2:
            break
        out = model(input_ids=chunk[None, :-1])
        nll += torch.nn.functional.cross_entropy(out.logits[0].float(), chunk[1:], reduction="sum").item()
        count += len(chunk) - 1
    for h in hooks:
        h.remove()

    rows = []
    for i, g in enumerate(gates):
        h = torch.cat(router_in[i])  # [T, H]: layer i's router input (post-attention RMSNorm output)
        actual = torch.topk(h @ g.weight.T, k, dim=-1).indices  # the layer's real top-K (as its router)
        counts = torch.bincount(actual.reshape(-1), minlength=n_exp).float()
        top_share = (counts.max() / counts.sum()).item()
        overlap = overlap_of([set(r) for r in actual.tolist()], k)
        recall = None
        if i > 0:
            # MoEpic Eq. 3: R_{i+1}(h_i) — here the prediction for layer i from layer i-1's router input.
            h_prev = torch.cat(router_in[i - 1])
            pred = torch.topk(h_prev @ g.weight.T, k, dim=-1).indices
            hit = (pred[:, :, None] == actual[:, None, :]).any(-1).sum(-1).float()
            recall = (hit / k).mean().item()
        rows.append({"layer": i, "top_share": top_share, "overlap": overlap, "recall": recall})
    loss = nll / max(count, 1)
    return {"rows": rows, "loss": loss, "ppl": math.exp(loss), "tokens": count, "k": k, "experts": n_exp}


def overlap_of(sets: list[set], k: int) -> float:
    """Mean |A_t ∩ A_{t-1}| / K over consecutive tokens (chunk boundaries included; they are rare)."""
    if len(sets) < 2:
        return float("nan")
    return sum(len(a & b) for a, b in zip(sets[1:], sets[:-1])) / (k * (len(sets) - 1))


# ------------------------------------------------------------------- the trace
def trace_routing(path: Path) -> dict:
    """Per layer: most-used expert's share and consecutive-token overlap, over complete tokens."""
    recs: dict[tuple, dict[int, list[int]]] = defaultdict(dict)
    n_layers = 0
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            recs[(r["dataset"], r["problem_id"], r["token_idx"])][r["layer"]] = r["experts"]
            n_layers = max(n_layers, r["layer"] + 1)
    complete = {key: v for key, v in recs.items() if len(v) == n_layers}
    by_seq: dict[tuple, list[tuple[int, dict]]] = defaultdict(list)
    for (ds, pid, t), v in complete.items():
        by_seq[(ds, pid)].append((t, v))
    k = len(next(iter(complete.values()))[0])
    rows = []
    for layer in range(n_layers):
        counts: dict[int, int] = defaultdict(int)
        inter, pairs = 0, 0
        for seq in by_seq.values():
            seq.sort()
            prev_t, prev = None, None
            for t, v in seq:
                cur = set(v[layer])
                for e in cur:
                    counts[e] += 1
                if prev is not None and t == prev_t + 1:
                    inter += len(cur & prev)
                    pairs += 1
                prev_t, prev = t, cur
        rows.append({"layer": layer, "top_share": max(counts.values()) / sum(counts.values()),
                     "overlap": inter / (k * max(pairs, 1))})
    return {"rows": rows, "tokens": len(complete), "k": k, "experts": 1 + max(
        e for v in complete.values() for l in v.values() for e in l)}


# ------------------------------------------------------------------- printing
def fmt(x, nd=3):
    return "–" if x is None else f"{x:.{nd}f}"


def report(m: dict, t: dict | None, model_name: str, text_name: str, trace_name: str) -> str:
    out = [
        f"Model: `{model_name}` (top-{m['k']} of {m['experts']} experts); text: {text_name}, {m['tokens']:,} tokens; "
        f"validation loss **{m['loss']:.3f}** nats/token, perplexity **{m['ppl']:.1f}**.",
    ]
    if t:
        out.append(f"Mixtral: `{trace_name}` (top-{t['k']} of {t['experts']}, {t['tokens']} complete tokens).")
    out.append("")
    head = "| layer | demo: top expert share | demo: consecutive overlap | demo: next-layer recall (Eq. 3) |"
    sep = "|---:|---:|---:|---:|"
    if t:
        head += " Mixtral: top expert share | Mixtral: consecutive overlap |"
        sep += "---:|---:|"
    out += [head, sep]
    n = max(len(m["rows"]), len(t["rows"]) if t else 0)
    for i in range(n):
        r = m["rows"][i] if i < len(m["rows"]) else None
        cells = [str(i)]
        cells += [fmt(r["top_share"]), fmt(r["overlap"]), fmt(r["recall"])] if r else ["", "", ""]
        if t:
            tr = t["rows"][i] if i < len(t["rows"]) else None
            cells += [fmt(tr["top_share"]), fmt(tr["overlap"])] if tr else ["", ""]
        out.append("| " + " | ".join(cells) + " |")

    def mean(rows, key):
        xs = [r[key] for r in rows if r.get(key) is not None]
        return sum(xs) / len(xs) if xs else None

    cells = ["mean", fmt(mean(m["rows"], "top_share")), fmt(mean(m["rows"], "overlap")), fmt(mean(m["rows"], "recall"))]
    if t:
        cells += [fmt(mean(t["rows"], "top_share")), fmt(mean(t["rows"], "overlap"))]
    out.append("| " + " | ".join(cells) + " |")
    rec = [r["recall"] for r in m["rows"] if r["recall"] is not None]
    out += [
        "",
        f"Demo ranges: top expert share {min(r['top_share'] for r in m['rows']):.3f}–"
        f"{max(r['top_share'] for r in m['rows']):.3f} (uniform {1 / m['experts']:.3f}); "
        f"overlap {min(r['overlap'] for r in m['rows']):.3f}–{max(r['overlap'] for r in m['rows']):.3f} "
        f"(independent random routing: {m['k'] / m['experts']:.3f}); "
        + (f"recall {min(rec):.3f}–{max(rec):.3f}." if rec else ""),
    ]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="checkpoint directory (default: the shipped demo)")
    p.add_argument("--text", help="text file to run (default: the held-out KJV chapters of the training split)")
    p.add_argument("--trace", default=None,
                   help=f"the real Mixtral routing trace (JSONL; default: ${mixtral_trace.ENV}); '' to skip")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=20000)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    trace = None if args.trace == "" else mixtral_trace.find(args.trace)
    if trace is None and args.trace != "":
        print(mixtral_trace.absent_line("the report without its Mixtral columns"), file=sys.stderr)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    model_dir = Path(args.model)
    if args.text:
        text, text_name = Path(args.text).read_text(encoding="utf-8"), args.text
    else:
        text, text_name = held_out_text(model_dir)
    m = model_routing(model_dir, text, args.seq_len, args.max_tokens)
    t = trace_routing(trace) if trace else None
    name = "fmoe_cli/models/demo_model" if model_dir.resolve() == DEFAULT_MODEL.resolve() else str(model_dir)
    print(report(m, t, name, text_name, trace.name if t else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
