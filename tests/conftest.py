"""Fixtures: tiny random checkpoints of every supported family, saved with
`save_pretrained` in the real on-disk layout (never downloaded)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# fmoe keeps profiles and routing statistics in the user's config directory: tests get a fresh one.
os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="fmoe-test-config-")
# … and converted (quantised) stores in its cache directory.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="fmoe-test-cache-")
for _directory in (os.environ["XDG_CONFIG_HOME"], os.environ["XDG_CACHE_HOME"]):  # removed when the run ends
    atexit.register(shutil.rmtree, _directory, ignore_errors=True)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)  # tiny models: threads only add noise and contention


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """family -> path of a tiny random checkpoint (built on first use)."""
    from fmoe_cli.models.demo import build_random_moe

    root = tmp_path_factory.mktemp("checkpoints")
    built: dict[str, object] = {}

    class Checkpoints(dict):
        def __missing__(self, family):
            self[family] = build_random_moe(root / family, family=family, seed=1)
            return self[family]

    return Checkpoints(built)
