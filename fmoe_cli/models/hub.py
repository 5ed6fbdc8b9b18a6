"""Files from the Hugging Face hub, with every failure as one line (a model's weights, or
`fmoe plan`'s config.json alone)."""

from __future__ import annotations

import warnings
from pathlib import Path

from huggingface_hub import snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from tqdm import TqdmExperimentalWarning
from tqdm.rich import tqdm as rich_tqdm

from fmoe_cli.errors import FmoeError


def download(repo_id: str, patterns: list[str], what: str, progress: bool = True) -> Path:
    """The snapshot directory of `repo_id` holding the files that match `patterns` (`what` they are, for
    messages). snapshot_download (not hf_hub_download): it fails at once without a network instead of
    retrying. A rich progress bar while downloading when `progress`."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TqdmExperimentalWarning)
            return Path(snapshot_download(repo_id, allow_patterns=patterns,
                                          **({"tqdm_class": rich_tqdm} if progress else {})))
    except GatedRepoError:
        raise FmoeError(f"{repo_id} is gated: accept its licence on the hub and log in (`hf auth login`)") from None
    except (RepositoryNotFoundError, RevisionNotFoundError, HFValidationError):
        raise FmoeError(f"unknown model id {repo_id!r}: not a local model and not found on the hub") from None
    except LocalEntryNotFoundError:  # (a subclass of EntryNotFoundError: first)
        raise FmoeError(f"cannot download {what}: no network (or HF_HUB_OFFLINE is set) and it is not in the "
                        f"local cache") from None
    except EntryNotFoundError:
        raise FmoeError(f"{repo_id} has no {what} on the hub") from None
    except OSError as exc:  # connection errors and the like
        raise FmoeError(f"cannot download {what}: {exc.__class__.__name__}: {str(exc).splitlines()[0]}") from None
