"""Files from the Hugging Face hub, with every failure as one line (a model's weights, or
`fmoe plan`'s config.json alone)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from fmoe_cli.errors import FmoeError


def local_model_dir(model_id: str) -> Path | None:
    """The local model directory `model_id` names, None for a hub id; a path that is not a model
    directory is a one-line FmoeError. No torch, no hub client: the command line checks it first."""
    local = Path(model_id).expanduser()
    if local.exists():
        if not local.is_dir() or not (local / "config.json").exists():
            raise FmoeError(f"{model_id} is not a model directory (no config.json in it)")
        return local
    looks_local = model_id.startswith((".", "/", "~")) or os.sep in model_id.strip("/").split("/", 1)[-1]
    if looks_local or model_id.count("/") > 1:
        raise FmoeError(f"no such model directory: {model_id}")
    return None


def local_config_path(model: str) -> Path | None:
    """The config.json a local path names (the file itself, or a model directory's), None for a hub id;
    a path that is neither is a one-line FmoeError. No torch, no hub client."""
    local = Path(model).expanduser()
    if local.is_file():
        return local
    if local.is_dir():
        if not (local / "config.json").exists():
            raise FmoeError(f"{model} has no config.json")
        return local / "config.json"
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise FmoeError(f"no such file or model directory: {model}")
    return None


def download(repo_id: str, patterns: list[str], what: str, progress: bool = True) -> Path:
    """The snapshot directory of `repo_id` holding the files that match `patterns` (`what` they are, for
    messages). snapshot_download (not hf_hub_download): it fails at once without a network instead of
    retrying. A rich progress bar while downloading when `progress`."""
    from huggingface_hub import snapshot_download  # the hub client: only when something is downloaded
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
