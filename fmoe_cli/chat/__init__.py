"""`fmoe chat`. The chat's own options and their defaults (the command line and ChatOptions read them);
checked here without torch, before anything heavy is imported."""

from __future__ import annotations

from dataclasses import dataclass, field

from fmoe_cli.errors import FmoeError
from fmoe_cli.types import REPETITION_PENALTY_RANGE, SEED_RANGE
from fmoe_cli.options import RunOptions

# Sampling where neither the command line nor the model's generation_config.json says (models/config.py
# `sampling_defaults`): temperature (0: greedy), nucleus threshold, top-k (0: off), min-p (0: off), repetition
# penalty (1: off).
SAMPLING = {"temperature": 0.7, "top_p": 0.9, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
MAX_NEW_TOKENS = 512  # the longest answer, in tokens


MIN_CONTEXT = 16  # tokens of KV cache a conversation is given at least (chat, serve: --context): a short message and answer


@dataclass(frozen=True)
class ChatOptions:
    """The run (model, policy, budget, …) and what only a chat has: the defaults live here."""

    run: RunOptions = field(default_factory=RunOptions)
    system: str | None = None
    temperature: float | None = None  # None: the model's generation_config.json, else SAMPLING's
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_new_tokens: int = MAX_NEW_TOKENS
    seed: int | None = None

    def check(self) -> None:
        """Refuse bad options in one line, without torch (as `RunOptions.check`)."""
        if self.temperature is not None and not 0 <= self.temperature < float("inf"):
            raise FmoeError(f"--temperature must be a number ≥ 0 (0 = greedy), got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise FmoeError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise FmoeError(f"--top-k must be 0 (off) or more, got {self.top_k}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise FmoeError(f"--min-p must be in [0, 1] (0: off), got {self.min_p}")
        low, high = REPETITION_PENALTY_RANGE
        if self.repetition_penalty is not None and not low <= self.repetition_penalty <= high:
            raise FmoeError(f"--repetition-penalty must be in [{low:g}, {high:g}] (1: off), got {self.repetition_penalty}")
        if self.max_new_tokens < 1:
            raise FmoeError("--max-new-tokens must be at least 1")
        if self.run.context is not None and self.run.context < MIN_CONTEXT:  # (0 is `fmoe plan`'s "no KV cache")
            raise FmoeError(f"--context must be at least {MIN_CONTEXT} tokens for a conversation (a message, its "
                            f"template and an answer), got {self.run.context}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise FmoeError(f"--seed must be between {SEED_RANGE[0]} and {SEED_RANGE[1]}, got {self.seed}")
        self.run.check()

    def sampling(self, recommended: dict[str, float | int]) -> tuple[dict[str, float | int], str]:
        """The sampling a chat runs with: each of SAMPLING's fields from the command line, else the
        model's `recommended` (models/config.py `sampling_defaults`), else SAMPLING; and where the defaults came from,
        for the header."""
        asked = {key: getattr(self, key) for key in SAMPLING}
        from_model = any(asked[key] is None and key in recommended for key in SAMPLING)
        return pick_sampling(asked, recommended, SAMPLING), "the model's generation_config.json" if from_model else ""


def pick_sampling(asked: dict, recommended: dict, defaults: dict) -> dict:
    """Each sampling field of `defaults` as `asked` (a command line's option, a request's field), else as the model
    `recommended` (models/config.py `sampling_defaults`), else the default (chat's SAMPLING, serve's OpenAI ones)."""
    return {key: asked[key] if asked.get(key) is not None else recommended.get(key, default)
            for key, default in defaults.items()}
