"""`fmoe bench` without a GPU: an emulated link shaped like a consumer card (profiling/reference.py),
labelled as such, and moepic, lru and resident side by side by default."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fmoe_cli.cli import app
from fmoe_cli.profiling.reference import CONSUMER_CARD

PROFILES = Path(__file__).resolve().parent.parent / "profiles"


def test_consumer_card_is_its_reference_profile():
    device = json.loads((PROFILES / CONSUMER_CARD.profile).read_text())["device"]
    assert device["link"]["bandwidth"] == CONSUMER_CARD.link_bandwidth
    assert device["memory_bandwidth"] == CONSUMER_CARD.memory_bandwidth
    assert 11 < CONSUMER_CARD.load_over_compute < 12  # 360 GB/s ÷ 31.5 GB/s
    # one expert of 10 MB computed in 1 ms loads in ~11.4 ms: 10 MB / 11.4 ms
    assert CONSUMER_CARD.link_gbps(10_000_000, 1e-3) == 10_000_000 / (CONSUMER_CARD.load_over_compute * 1e-3) / 1e9


def test_a_shaped_link_is_never_slower_than_an_emulated_link_may_be():
    """A tiny expert timed on a busy machine (T_exp large) gave a derived link below the minimum, and
    `fmoe bench` on the CPU stopped with '--emulate-link … is slower than any host→device link'."""
    from fmoe_cli.offload import MIN_EMULATED_GBPS, check_bandwidth

    assert CONSUMER_CARD.link_gbps(1 << 30, 1e-3) == pytest.approx((1 << 30) / (CONSUMER_CARD.load_over_compute * 1e-3) / 1e9)
    slow = CONSUMER_CARD.link_gbps(4096, 0.05)  # 4 KiB expert, 50 ms: 0.0000036 GB/s unclamped
    assert slow == MIN_EMULATED_GBPS
    check_bandwidth(slow)  # accepted


def test_bench_defaults_to_a_shaped_link_and_shows_resident(checkpoints, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    result = CliRunner().invoke(app, ["bench", str(checkpoints["mixtral"]), "--tokens", "2", "--warmup", "1",
                                      "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [r["policy"] for r in report["runs"]] == ["moepic", "lru", "resident"]
    link = report["link"]
    assert link["kind"] == "emulated" and link["gbps"] > 0
    assert "shaped like" in link["label"] and CONSUMER_CARD.profile in link["label"]
    # an explicit --emulate-link wins, and is not labelled as a card
    result = CliRunner().invoke(app, ["bench", str(checkpoints["mixtral"]), "--policy", "lru", "--tokens", "2",
                                      "--warmup", "1", "--device", "cpu", "--emulate-link", "7", "--json"])
    assert result.exit_code == 0, result.output
    label = json.loads(result.stdout)["link"]["label"]
    assert label == "link: emulated 7 GB/s"


def test_bench_leaves_resident_out_when_it_does_not_fit(checkpoints, tmp_path, monkeypatch):
    """The default resident is left out with a note when every expert would not fit; asked for, it is an error."""
    import fmoe_cli.run as run
    from fmoe_cli.errors import FmoeError

    def check_plan_fits(plan, room):  # a device too small for every expert, large enough for the rest
        if plan.resident:
            raise FmoeError("resident needs more than this device has (test)")

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.setattr(run, "check_plan_fits", check_plan_fits)
    result = CliRunner().invoke(app, ["bench", str(checkpoints["mixtral"]), "--tokens", "2", "--warmup", "1",
                                      "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    assert [r["policy"] for r in json.loads(result.stdout)["runs"]] == ["moepic", "lru"]
    result = CliRunner().invoke(app, ["bench", str(checkpoints["mixtral"]), "--policy", "lru", "--policy", "resident",
                                      "--device", "cpu", "--tokens", "2"])
    assert result.exit_code == 2 and "resident needs more" in result.output


def test_the_shaped_link_is_measured_once_a_model_and_kept(checkpoints, tmp_path, monkeypatch, capsys):
    """Runs without a GPU compare: the shaped link is measured once (its model and compute dtype) and read by the next
    runs, whatever their own T_exp reads (a busy machine made it 1.8–4.1 GB/s from one run to the next); a file that
    does not read is set aside and measured again; an unwritable config directory leaves the figure to the run."""
    import fmoe_cli.run as run
    from fmoe_cli.models.load import load_model

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    lm = load_model(str(checkpoints["mixtral"]), device="cpu", dtype="float32")
    times = iter([1e-5, 3e-5, 2e-5])  # (a tiny expert: links above MIN_EMULATED_GBPS)
    monkeypatch.setattr(run, "expert_compute_s", lambda lm, **kw: next(times))
    expert = replace(lm.shape, experts="bf16").expert_bytes
    first = run.shaped_link_gbps(lm)
    assert first == pytest.approx(CONSUMER_CARD.link_gbps(expert, 1e-5))
    assert run.shaped_link_gbps(lm) == first  # kept: T_exp not measured again (3e-5 unused)
    (kept,) = (tmp_path / "config" / "fmoe" / "profiles").glob("*.shaped-link.json")
    from fmoe_cli.profiling.host import machine_digest

    assert f".{machine_digest()}.shaped-link.json" in kept.name  # (a config directory two machines share)
    corrected = replace(CONSUMER_CARD, memory_bandwidth=CONSUMER_CARD.memory_bandwidth * 2)
    monkeypatch.setattr(run, "CONSUMER_CARD", corrected)  # a corrected card: the kept T_exp, the new card's link
    assert run.shaped_link_gbps(lm) == pytest.approx(corrected.link_gbps(expert, 1e-5)) != first
    monkeypatch.setattr(run, "CONSUMER_CARD", CONSUMER_CARD)
    kept.write_text("{not json")
    again = run.shaped_link_gbps(lm)  # set aside, measured again: 3e-5
    assert again == pytest.approx(CONSUMER_CARD.link_gbps(expert, 3e-5)) and "moved to" in capsys.readouterr().err
    assert len(list(kept.parent.glob("*.shaped-link.json.corrupt-*"))) == 1
    monkeypatch.setenv("XDG_CONFIG_HOME", "/proc/no-such-config")  # not writable: measured, not kept
    assert run.shaped_link_gbps(lm) == pytest.approx(CONSUMER_CARD.link_gbps(expert, 2e-5))
    lm.store.close()
