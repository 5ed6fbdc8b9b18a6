"""The one error type the CLI turns into a one-line message and exit code 2."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class FmoeError(Exception):
    """Bad input or an unsupported model: the message is shown to the user as one line."""


def unknown_device(device: str) -> FmoeError:
    """A --device that is not auto, cpu or cuda[:N] (options.py before torch, models/load.py after: one line)."""
    return FmoeError(f"unknown device {device!r}; use auto, cpu or cuda[:N]")


def no_gpu(device: str) -> FmoeError:
    """A CUDA --device on a machine without one (options.py before torch where surely none, models/load.py after)."""
    return FmoeError(f"device {device} requested but no CUDA GPU is available")


@contextmanager
def reading(path, what: str) -> Iterator[None]:
    """Turn the errors of reading a user's file (`what`: "trace", "prompt file", …) into one-line FmoeErrors."""
    try:
        yield
    except FileNotFoundError:
        raise FmoeError(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise FmoeError(f"{what} {path} is a directory, not a file") from None
    except UnicodeDecodeError:
        raise FmoeError(f"{what} {path} is not a text (UTF-8) file") from None
    except OSError as exc:
        raise FmoeError(f"cannot read {what} {path}: {exc.strerror or exc}") from None


def warn(message: str) -> None:
    """Work goes on, something is worth knowing (a save skipped, a damaged file set aside): one line on stderr."""
    from rich.console import Console
    from rich.text import Text

    Console(stderr=True).print(Text.assemble(("warning:", "bold yellow"), " ", message), highlight=False, soft_wrap=True)
