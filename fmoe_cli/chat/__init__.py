"""`fmoe chat`. The chat's own options and their defaults (the command line and ChatOptions read them);
checked here without torch, before anything heavy is imported."""

from __future__ import annotations

from dataclasses import dataclass, field

from fmoe_cli.errors import FmoeError
from fmoe_cli.types import SEED_RANGE
from fmoe_cli.options import RunOptions

TEMPERATURE = 0.7  # 0: greedy
TOP_P = 0.9  # nucleus sampling threshold
MAX_NEW_TOKENS = 512  # the longest answer, in tokens


MIN_CONTEXT = 16  # tokens of KV cache a conversation is given at least (chat, serve: --context): a short message and answer


@dataclass(frozen=True)
class ChatOptions:
    """The run (model, policy, budget, …) and what only a chat has: the defaults live here."""

    run: RunOptions = field(default_factory=RunOptions)
    system: str | None = None
    temperature: float = TEMPERATURE
    top_p: float = TOP_P
    max_new_tokens: int = MAX_NEW_TOKENS
    seed: int | None = None

    def check(self) -> None:
        """Refuse bad options in one line, without torch (as `RunOptions.check`)."""
        if not 0 <= self.temperature < float("inf"):
            raise FmoeError(f"--temperature must be a number ≥ 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise FmoeError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise FmoeError("--max-new-tokens must be at least 1")
        if self.run.context is not None and self.run.context < MIN_CONTEXT:  # (0 is `fmoe plan`'s "no KV cache")
            raise FmoeError(f"--context must be at least {MIN_CONTEXT} tokens for a conversation (a message, its "
                            f"template and an answer), got {self.run.context}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise FmoeError(f"--seed must be between {SEED_RANGE[0]} and {SEED_RANGE[1]}, got {self.seed}")
        self.run.check()
