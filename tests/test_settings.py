"""Every MPITP_* variable in one place: one rule for booleans and sizes, invalid values
named, docs/environment.md's table in step with the code; the parsers fuzzed (hypothesis)."""

import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from mpitp import settings
from mpitp.settings import Settings, SettingsError
from mpitp.units import parse_size

README = Path(__file__).resolve().parent.parent / "docs" / "environment.md"  # the variables' table


@pytest.mark.parametrize(
    "raw,want",
    [
        ("1", True),
        ("0", False),
        ("False", False),
        ("OFF", False),
        ("no", False),
        ("Yes", True),
        ("on", True),
        (" true ", True),
    ],
)
def test_booleans_one_rule(raw, want):
    assert Settings.from_env({"MPITP_SHM": raw}).shm is want
    assert Settings.from_env({"MPITP_CMA": raw}).cma is want


@pytest.mark.parametrize(
    "env,message",
    [
        ({"MPITP_SHM": "maybe"}, "MPITP_SHM='maybe'"),
        ({"MPITP_TIMEOUT": "soon"}, "MPITP_TIMEOUT='soon'"),
        ({"MPITP_TIMEOUT": "-1"}, "MPITP_TIMEOUT='-1'"),
        ({"MPITP_RING_SEGMENT": "0"}, "MPITP_RING_SEGMENT='0'"),
        ({"MPITP_RING_SEGMENT": "lots"}, "MPITP_RING_SEGMENT 'lots' is not a size"),
        ({"MPITP_RING_DEPTH": "0"}, "MPITP_RING_DEPTH='0'"),
        ({"MPITP_RANKS_PER_NODE": "2.5"}, "MPITP_RANKS_PER_NODE='2.5'"),
        ({"MPITP_CMA_SEGMENT": "8"}, "at least 64"),
        ({"MPITP_LOG_LEVEL": "chatty"}, "MPITP_LOG_LEVEL='chatty'"),
    ],
)
def test_invalid_values_name_the_variable(env, message):
    with pytest.raises(SettingsError, match=re.escape(message)):
        Settings.from_env(env)


def test_sizes_and_defaults():
    s = Settings.from_env({"MPITP_RING_SEGMENT": "64K", "MPITP_SHM_MAX": "8MB", "MPITP_TIMEOUT": "0"})
    assert (s.ring_segment, s.shm_max, s.timeout) == (65536, 8_000_000, None)
    assert Settings.from_env({}) == Settings()


def test_current_follows_the_environment(monkeypatch):
    monkeypatch.setenv("MPITP_RING_DEPTH", "7")
    assert settings.current().ring_depth == 7
    monkeypatch.setenv("MPITP_RING_DEPTH", "3")
    assert settings.current().ring_depth == 3


def test_readme_table_matches_the_settings():
    text = README.read_text()
    table = text[text.index("| variable | effect |") :]
    table = table.split("\n\n")[0]
    documented = set(re.findall(r"`(MPITP_[A-Z_]+)", table))
    assert documented == set(settings.VARIABLES), documented ^ set(settings.VARIABLES)


def test_no_module_reads_mpitp_variables_itself():
    pkg = Path(settings.__file__).parent
    offenders = [
        str(p.relative_to(pkg))
        for p in pkg.rglob("*.py")
        if p.name != "settings.py" and re.search(r"environ(?:\.get)?\(?\[?[\"']MPITP_", p.read_text())
    ]
    assert not offenders, offenders


@hsettings(max_examples=400, deadline=None)
@given(st.text(max_size=12))
def test_parse_size_fuzz(text):
    try:
        n = parse_size(text)
    except ValueError as e:
        assert repr(text) in str(e)
    else:
        assert isinstance(n, int) and n >= 0


@hsettings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(settings.VARIABLES)), st.text(max_size=10))
def test_settings_fuzz(var, raw):
    try:
        Settings.from_env({var: raw})
    except SettingsError as e:
        assert var in str(e)


@pytest.mark.parametrize(
    "text,want",
    [
        ("8MB", 8_000_000),
        ("8MiB", 8 << 20),
        ("8M", 8 << 20),
        ("4k", 4096),
        ("1.5 GiB", 3 << 29),
        ("512B", 512),
        ("1e3", 1000),
    ],
)
def test_one_size_convention(text, want):
    assert parse_size(text) == want


def test_size_lists_for_the_benchmarks():
    """benchmarks/ take comma-separated sizes the way the CLI takes one (64K, 4M, ...);
    a bad one is argparse's usage error naming it."""
    import argparse

    from mpitp.units import size_list

    assert size_list("4100,64K,4M,8MB") == [4100, 65536, 4 << 20, 8_000_000]
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=size_list, default="64K,1M")
    assert ap.parse_args([]).sizes == [65536, 1 << 20]
    with pytest.raises(SystemExit):
        ap.parse_args(["--sizes", "4M,4Q"])
