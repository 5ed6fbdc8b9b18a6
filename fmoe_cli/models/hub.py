"""Files from the Hugging Face hub, with every failure as one line (a model's weights, or
`fmoe plan`'s config.json alone)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from fmoe_cli.errors import FmoeError

DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "tokenizer*", "*.py"]  # a model's files
_fetched: dict[tuple[str, tuple[str, ...]], Path] = {}  # (repo id, patterns) -> its snapshot: asked once a process


def model_patterns(trust_remote_code: bool) -> list[str]:
    """The files of a model a run downloads: its code (*.py) only when the user trusts it."""
    return DOWNLOAD_PATTERNS if trust_remote_code else [p for p in DOWNLOAD_PATTERNS if p != "*.py"]


def fetch_model_early(model: str, trust_remote_code: bool, check=None) -> None:
    """A hub id's files downloaded (or found in the local cache) by a command: its config.json first, alone, before
    the command imports torch and transformers (6–8 s), so that an unknown id or a missing network is one line in
    under a second; then `check(config_path)` (the command's checks of the model: models/config.py
    `check_servable`, the options against its context, host RAM, and the model built on the meta device, which
    imports torch) and the disk's room for the rest (`check_room`) refuse what cannot run here before the weights
    are downloaded.
    A local directory or `demo` is left to the command. The snapshot is kept for the command's own `download` of
    the same files (no second look at the hub)."""
    if model == "demo" or local_model_dir(model) is not None:
        return
    config = fetch_config_early(model)  # (a hub id's: config.json alone)
    if check is not None:
        check(config)
    check_room(model, model_patterns(trust_remote_code))
    download_model(model, trust_remote_code)


def check_room(repo_id: str, patterns: list[str]) -> None:
    """The disk's room for a hub snapshot (models/room.py `check_download_room`), from the hub's list of the
    repository's files and their sizes. Where the list cannot be had (no network, an older hub client, the cache
    complete), nothing is checked: the download that follows says what went wrong."""
    listing = snapshot_files(repo_id, patterns)
    if listing is not None:
        from fmoe_cli.models.room import check_download_room

        check_download_room(repo_id, *listing)


LISTING_TIMEOUT_S = 10.0  # the hub's list of a repository's files: one request, no retries (a check, not the download)


def snapshot_files(repo_id: str, patterns: list[str]) -> tuple[list[tuple[str, int]], set[str], Path] | None:
    """(name, bytes) of each file of `repo_id` that `patterns` select, the names whose bytes the local cache already
    holds (a blob of an earlier snapshot counts: the download links it, as when only config.json moved `main` on), and
    the cache's directory; None where the hub does not answer at once (no network: one request, no retries)."""
    try:
        from huggingface_hub import HfApi, constants, try_to_load_from_cache
        from huggingface_hub.utils import filter_repo_objects

        info = HfApi().model_info(repo_id, files_metadata=True, timeout=LISTING_TIMEOUT_S)
        siblings = {s.rfilename: s for s in info.siblings or []}
        wanted = list(filter_repo_objects(list(siblings), allow_patterns=patterns))
        blobs = Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}" / "blobs"

        def held(name: str) -> bool:
            sibling = siblings[name]
            blob = sibling.lfs.sha256 if sibling.lfs else sibling.blob_id
            return bool(blob) and (blobs / blob).is_file() or isinstance(try_to_load_from_cache(repo_id, name), str)

        files = [(name, (siblings[name].lfs.size if siblings[name].lfs else siblings[name].size) or 0) for name in wanted]
        return files, {name for name in wanted if held(name)}, Path(constants.HF_HUB_CACHE)
    except Exception:  # (any failure of the hub client's listing: the check is a courtesy, the download decides)
        return None


def download_model(repo_id: str, trust_remote_code: bool) -> Path:
    """The snapshot of a hub model's files (`model_patterns`), downloaded once a process."""
    return download(repo_id, model_patterns(trust_remote_code), repo_id)


def fetch_config_early(model: str) -> Path | None:
    """`fetch_model_early` for `fmoe plan`: a hub id's config.json alone, downloaded; returns the config.json the
    model names (a hub id's, a local config.json or directory's), None for `demo`."""
    if model == "demo":
        return None
    local = local_config_path(model)
    if local is not None:
        return local
    return download(model, ["config.json"], f"{model}'s config.json", progress=False) / "config.json"


SHIPPED_DEMO = Path(__file__).parent / "demo_model"  # the trained demo the package ships (models/demo.py: SHIPPED)


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
    retrying. A rich progress bar while downloading when `progress`. Once per process for the same files
    (`fetch_model_early` and `fetch_config_early` ask first)."""
    fetched = _fetched.get((repo_id, tuple(patterns)))
    if fetched is not None:
        return fetched
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
            path = Path(snapshot_download(repo_id, allow_patterns=patterns,
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
    _fetched[(repo_id, tuple(patterns))] = path
    return path
