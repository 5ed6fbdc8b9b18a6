"""`fmoe chat`. The chat's own options and their defaults (the command line and ChatOptions read them);
checked here without torch, before anything heavy is imported."""

from __future__ import annotations

from dataclasses import dataclass, field

from fmoe_cli.errors import FmoeError
from fmoe_cli.options import RunOptions

TEMPERATURE = 0.7  # 0: greedy
TOP_P = 0.9  # nucleus sampling threshold
MAX_NEW_TOKENS = 512  # the longest answer, in tokens


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
        self.run.check()
