#!/usr/bin/env python3
"""Train fmoe's built-in `demo` model: a small Qwen3-MoE on the King James Bible, on CPU.

The result is a standard transformers checkpoint (``save_pretrained``): a
``Qwen3MoeForCausalLM`` (safetensors, bfloat16 values) with a byte-level BPE
tokenizer trained here with the ``tokenizers`` library and a chat template, so
it loads through exactly the same path as a hub model.

Corpus: the King James Version (1611) from Debian's ``bible-kjv-text`` package
(read with the ``bible`` program of ``bible-kjv``; ``apt-get install bible-kjv``).
The KJV text is in the public domain (its copyright expired; Debian's
copyright file: "The copyright for the King James Version text of the Bible is
expired"). Any plain-text file can be given instead with ``--corpus FILE``
(blank-line separated blocks, one sentence/verse per line).

Seeded and reproducible: the held-out split, the tokenizer, the initial
weights, the order of training windows and the chat examples all follow from
``--seed``. (Float sums may differ in the last bits with another thread count.)

    # the shipped model (1,600 steps: about 65 minutes on one core of a shared 2-core machine):
    python tools/train_demo.py --out /tmp/demo_run
    cp /tmp/demo_run/final/* fmoe_cli/models/demo_model/

    # smoke test (seconds):
    python tools/train_demo.py --tiny --steps 3 --out /tmp/tiny
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

SPECIALS = ["<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
PAD, EOS = "<|pad|>", "<|end|>"
# One turn = <|role|>content<|end|>; the generation prompt is <|assistant|>.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SYSTEM_PROMPTS = [
    "You are a tiny demo model trained on the King James Bible.",
    "Continue the text in the style of the King James Bible.",
]
CHAPTER_RE = re.compile(r"^(?:[1-3] )?[A-Z][A-Za-z]*(?: [A-Za-z]+)* \d+$")
VERSE_RE = re.compile(r"^\s+(\d+) (.*)$")


# --------------------------------------------------------------------- corpus
def kjv_text() -> str:
    """The whole KJV as printed by Debian's `bible` program, one verse a line."""
    exe = shutil.which("bible")
    if exe is None:
        sys.exit(
            "the `bible` program is missing: `apt-get install bible-kjv` (it pulls in bible-kjv-text), "
            "or give a plain-text corpus with --corpus FILE"
        )
    out = subprocess.run(
        [exe, "-l100000", "gen1:1-rev22:21"], stdin=subprocess.DEVNULL, capture_output=True, text=True, check=True
    )
    return out.stdout


def parse_kjv(text: str) -> list[tuple[str, list[str]]]:
    """[(chapter title, [verse, ...]), ...] from `bible` output."""
    chapters: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        if CHAPTER_RE.match(line):
            chapters.append((line.strip(), []))
            continue
        m = VERSE_RE.match(line)
        if m and chapters:
            chapters[-1][1].append(" ".join(m.group(2).split()))
        elif chapters and chapters[-1][1]:  # a wrapped continuation line
            chapters[-1][1][-1] += " " + " ".join(line.split())
    return [c for c in chapters if c[1]]


def parse_plain(text: str) -> list[tuple[str, list[str]]]:
    """Blocks separated by blank lines; one verse/sentence per line."""
    blocks = [b for b in re.split(r"\n\s*\n", text) if b.strip()]
    return [("", [" ".join(line.split()) for line in b.splitlines() if line.strip()]) for b in blocks]


def load_corpus(path: str | None) -> tuple[list[tuple[str, list[str]]], str, str]:
    if path:
        text = Path(path).read_text(encoding="utf-8")
        chapters = parse_kjv(text) if any(CHAPTER_RE.match(x) for x in text.splitlines()[:5]) else parse_plain(text)
        source = f"file {path}"
    else:
        text = kjv_text()
        chapters = parse_kjv(text)
        source = "King James Version via Debian bible-kjv-text (`bible -l100000 gen1:1-rev22:21`)"
    return chapters, source, hashlib.sha256(text.encode()).hexdigest()


def chapter_doc(title: str, verses: list[str]) -> str:
    body = "\n".join(verses)
    return f"{title}\n{body}" if title else body


def chat_docs(chapters, rng: random.Random, per_chapter: int) -> list[str]:
    """Chat-formatted examples: the user gives a verse, the assistant goes on with the next ones."""
    docs = []
    for _title, verses in chapters:
        if len(verses) < 2:
            continue
        for _ in range(per_chapter):
            i = rng.randrange(0, len(verses) - 1)
            n_user = 1 + (rng.random() < 0.3)
            user = " ".join(verses[i : i + n_user])
            j = min(i + n_user, len(verses) - 1)
            reply = " ".join(verses[j : j + rng.randint(1, 3)])
            system = f"<|system|>{rng.choice(SYSTEM_PROMPTS)}{EOS}" if rng.random() < 0.3 else ""
            docs.append(f"{system}<|user|>{user}{EOS}<|assistant|>{reply}{EOS}")
    return docs


# ------------------------------------------------------------------ tokenizer
def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS)
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 1024
    return fast


def encode_stream(tokenizer, docs: list[str]):
    import torch

    eos = tokenizer.convert_tokens_to_ids(EOS)
    ids: list[int] = []
    for enc in tokenizer.backend_tokenizer.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
        if not ids or ids[-1] != eos:
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


# ---------------------------------------------------------------------- model
def make_config(args, tokenizer):
    from transformers import Qwen3MoeConfig

    common = dict(
        vocab_size=len(tokenizer),
        hidden_act="silu",
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        output_router_logits=True,
        router_aux_loss_coef=args.aux_coef,
        attention_dropout=0.0,
        initializer_range=0.02,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    if args.tiny:
        shape = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                     head_dim=32, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                     num_experts_per_tok=2)
    else:
        shape = dict(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=args.hidden // 4, intermediate_size=4 * args.hidden,
                     moe_intermediate_size=args.expert_inter, num_experts=args.experts,
                     num_experts_per_tok=args.top_k)
    return Qwen3MoeConfig(**common, **shape)


def save_checkpoint(model, tokenizer, out: Path, info: dict) -> None:
    """Write a complete checkpoint to a temporary dir, then swap it in (never half-written)."""
    import torch
    from transformers import GenerationConfig

    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    state = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
    model.save_pretrained(tmp, state_dict=state, safe_serialization=True)
    cfg_path = tmp / "config.json"
    cfg = json.loads(cfg_path.read_text())
    # Values are bf16-exact; compute in float32 (bf16 -> fp32 is lossless), which fmoe uses on CPU.
    cfg["dtype"] = "float32"
    # Router logits are asked for explicitly while training (aux loss); inference does not need them.
    cfg["output_router_logits"] = False
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    GenerationConfig(
        do_sample=True, temperature=0.7, top_p=0.95, max_new_tokens=128,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "training_info.json").write_text(json.dumps(info, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def evaluate(model, val, seq_len: int, max_windows: int) -> float:
    import torch

    model.eval()
    n = min(max_windows, (len(val) - 1) // seq_len)
    total, count = 0.0, 0
    with torch.no_grad():
        for b in range(0, n, 8):
            idx = range(b, min(n, b + 8))
            x = torch.stack([val[i * seq_len : i * seq_len + seq_len + 1] for i in idx])
            out = model(input_ids=x[:, :-1], output_router_logits=False)
            logits = out.logits.float()
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"
            )
            total += loss.item()
            count += x[:, 1:].numel()
    model.train()
    return total / max(count, 1)


# ----------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="run directory; checkpoints go to OUT/latest and OUT/final")
    p.add_argument("--corpus", help="plain-text corpus file (default: the KJV from Debian's bible-kjv)")
    p.add_argument("--tiny", action="store_true", help="tiny model on a tiny slice of the corpus (smoke test)")
    p.add_argument("--steps", type=int, default=1600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the machine is shared: default 1)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-frac", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--aux-coef", type=float, default=0.02, help="router load-balancing loss coefficient")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--expert-inter", type=int, default=192)
    p.add_argument("--chat-per-chapter", type=int, default=8, help="chat examples made from each chapter")
    p.add_argument("--val-every", type=int, default=40, help="every Nth chapter is held out for validation")
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--save-every", type=int, default=200)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--max-minutes", type=float, default=0.0, help="stop early (and save) after this wall time")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from transformers import Qwen3MoeForCausalLM

    t_start = time.time()
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    chapters, source, digest = load_corpus(args.corpus)
    if args.tiny:
        chapters = chapters[:12]
        args.vocab, args.seq_len, args.batch = min(args.vocab, 400), min(args.seq_len, 64), min(args.batch, 4)
        args.eval_every = args.save_every = max(1, args.steps)
    if len(chapters) < 2:
        sys.exit("corpus too small: need at least two blocks")
    val_ch = [c for i, c in enumerate(chapters) if i % args.val_every == args.val_every // 2]
    train_ch = [c for i, c in enumerate(chapters) if i % args.val_every != args.val_every // 2] or chapters
    if not val_ch:
        val_ch = chapters[-1:]
    rng = random.Random(args.seed)
    train_docs = [chapter_doc(t, v) for t, v in train_ch] + chat_docs(train_ch, rng, args.chat_per_chapter)
    rng.shuffle(train_docs)
    val_docs = [chapter_doc(t, v) for t, v in val_ch]

    tokenizer = train_tokenizer(train_docs, args.vocab)
    train = encode_stream(tokenizer, train_docs)
    val = encode_stream(tokenizer, val_docs)
    print(f"corpus: {source}; {len(train_ch)} train / {len(val_ch)} val blocks; "
          f"{len(train):,} train / {len(val):,} val tokens; vocab {len(tokenizer)}", flush=True)

    config = make_config(args, tokenizer)
    model = Qwen3MoeForCausalLM(config).float()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f} M parameters "
          f"({config.num_hidden_layers} layers, {config.num_experts} experts, top-{config.num_experts_per_tok}, "
          f"hidden {config.hidden_size}, expert intermediate {config.moe_intermediate_size})", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "gate.weight" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "gate.weight" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        frac = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))

    gen = torch.Generator().manual_seed(args.seed)
    n_windows = len(train) - args.seq_len - 1
    info = {
        "corpus": source, "corpus_sha256": digest,
        "licence": "King James Version text: public domain (copyright expired)" if not args.corpus else "see corpus",
        # the run directory by its name only: the shipped file names no path of the machine it was trained on
        "args": {**vars(args), "out": Path(args.out).name}, "parameters": n_params, "train_tokens": len(train), "val_tokens": len(val),
    }
    history = []
    model.train()
    step, t_loop = 0, time.time()
    ema = None
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        starts = torch.randint(0, n_windows, (args.batch,), generator=gen)
        x = torch.stack([train[s : s + args.seq_len + 1] for s in starts.tolist()])
        out_ = model(input_ids=x[:, :-1], output_router_logits=True)
        logits = out_.logits.float()
        lm_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        aux = out_.aux_loss if out_.aux_loss is not None else torch.zeros(())
        loss = lm_loss + args.aux_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = lm_loss.item() if ema is None else 0.95 * ema + 0.05 * lm_loss.item()
        if step % args.log_every == 0 or step == args.steps - 1:
            el = time.time() - t_loop
            print(f"step {step:5d}  loss {lm_loss.item():.4f} (ema {ema:.4f})  aux {aux.item():.4f}  "
                  f"lr {lr_at(step):.2e}  {el / (step + 1):.2f} s/step  {el / 60:.1f} min", flush=True)
        done = step == args.steps - 1 or (args.max_minutes and time.time() - t_start > 60 * args.max_minutes)
        if (step + 1) % args.eval_every == 0 or done:
            vl = evaluate(model, val, args.seq_len, 64 if not args.tiny else 2)
            history.append({"step": step + 1, "train_loss_ema": round(ema, 4), "val_loss": round(vl, 4),
                            "minutes": round((time.time() - t_start) / 60, 2)})
            print(f"eval step {step + 1}: val loss {vl:.4f}  ppl {math.exp(vl):.2f}", flush=True)
        if (step + 1) % args.save_every == 0 or done:
            info.update(steps_done=step + 1, history=history, wall_minutes=round((time.time() - t_start) / 60, 2))
            save_checkpoint(model, tokenizer, out / ("final" if done else "latest"), info)
            print(f"saved {out / ('final' if done else 'latest')}", flush=True)
        if done:
            break
    print(f"done: {step + 1} steps in {(time.time() - t_start) / 60:.1f} min", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
