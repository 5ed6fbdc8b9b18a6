"""Fixtures: tiny random checkpoints of every supported family, saved with
`save_pretrained` in the real on-disk layout (never downloaded).

`python -m pytest` runs the suite on two worker processes (pytest-xdist, in the `test` extra; see
`pytest_cmdline_main` below). Each process, the workers and the controller, gets its own config and
cache directories, so no test sees another's profiles, statistics or converted stores; the compiled
CPU kernels are shared by all of them (one compile per run, under build.py's file lock)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

# CI's machine (and this project's) has 2 cores; the tiny models run one torch thread each (below).
WORKERS = 2


def _fresh_directory(variable: str, prefix: str, *, shared: bool = False) -> None:
    """Point `variable` at a new temporary directory, removed when the process that made it ends.
    shared: a worker keeps the one its controller made (it inherits the environment)."""
    if shared and os.environ.get(variable, "").startswith(os.path.join(tempfile.gettempdir(), prefix)):
        return
    os.environ[variable] = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, os.environ[variable], ignore_errors=True)


os.environ.setdefault("HF_HUB_OFFLINE", "1")
# fmoe keeps profiles and routing statistics in the user's config directory: tests get a fresh one.
_fresh_directory("XDG_CONFIG_HOME", "fmoe-test-config-")
# … and converted (quantised) stores in its cache directory.
_fresh_directory("XDG_CACHE_HOME", "fmoe-test-cache-")
# The C kernels (fmoe_cli/kernels) compile once per run, not once per worker.
_fresh_directory("FMOE_KERNEL_CACHE", "fmoe-test-kernels-", shared=True)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """Without -n: WORKERS worker processes (`--dist worksteal`: each takes half the tests in their order,
    one that runs out takes over the end of the other's). Stays in one process with -n 0, -p no:xdist,
    --pdb, pytest-xdist not installed, or when only single tests (`file::test`) are named."""
    if not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput"):
        return  # no xdist, or a worker itself
    option = config.option
    single_tests = bool(option.file_or_dir) and all("::" in arg for arg in option.file_or_dir)
    if option.numprocesses is None and not option.tx and not option.usepdb and not single_tests:
        option.numprocesses = WORKERS
        if option.dist == "no":
            option.dist = "worksteal"


def pytest_configure(config):
    """In a process that runs tests (not xdist's controller, which only hands them out and imports no torch)."""
    controller = config.pluginmanager.hasplugin("xdist") and config.option.dist != "no"
    if not controller:
        import torch

        torch.set_num_threads(1)  # tiny models: threads only add noise and contention (and 2 workers share 2 cores)


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


@pytest.fixture
def without_kernels(monkeypatch):
    """FMOE_KERNELS=torch for one test (as a machine without a compiler; torch's path, as benchmarks/host_per_layer.py
    measures a GPU's): the library's cache cleared around it."""
    from fmoe_cli import kernels

    monkeypatch.setenv("FMOE_KERNELS", "torch")
    kernels.library.cache_clear()
    yield
    monkeypatch.delenv("FMOE_KERNELS")
    kernels.library.cache_clear()


@pytest.fixture
def mixtral_trace():
    """The real Mixtral-8x7B routing trace (not shipped, no open licence: docs/traces.md § Real routing says where to
    get it), named by $FMOE_MIXTRAL_TRACE; the test skips without it."""
    from pathlib import Path

    given = os.environ.get("FMOE_MIXTRAL_TRACE")
    if not given or not Path(given).is_file():
        pytest.skip("the Mixtral trace is not here (set FMOE_MIXTRAL_TRACE: docs/traces.md § Real routing)")
    return Path(given)
