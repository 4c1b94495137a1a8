"""Every ``FIMOE_*`` environment value is parsed by one set of functions (:mod:`fimoe_lab.env`): one set of
boolean spellings, integers within bounds, and a bad value is one clear ``error:`` line naming the
variable (or, inside a serving engine, one logged warning and nothing installed).
"""

from __future__ import annotations

import logging

import pytest
from test_bad_inputs import BACKEND, copy_sample, error_after_progress, leftovers, run

from fimoe_lab import env
from fimoe_lab.errors import FimoeError
from fimoe_lab.integrations import vllm

SPELLINGS = [(s, True) for s in env.TRUE] + [(s, False) for s in env.FALSE]
VARIANTS = [lambda s: s, str.upper, str.title, lambda s: f"  {s}\t"]


@pytest.mark.parametrize("raw,value", SPELLINGS)
@pytest.mark.parametrize("variant", range(len(VARIANTS)))
def test_every_boolean_spelling_in_any_case_with_blanks(raw, value, variant, monkeypatch):
    monkeypatch.setenv("FIMOE_TEST_BOOL", VARIANTS[variant](raw))
    assert env.env_bool("FIMOE_TEST_BOOL", not value) is value


@pytest.mark.parametrize("raw", ["2", "y", "n", "enable", "disabled", "truee", "o n", "-1", "1.0", "\x1b[2J"])
def test_anything_else_is_not_a_boolean(raw, monkeypatch):
    monkeypatch.setenv("FIMOE_TEST_BOOL", raw)
    with pytest.raises(FimoeError, match="FIMOE_TEST_BOOL=.* is not a boolean"):
        env.env_bool("FIMOE_TEST_BOOL", False)


@pytest.mark.parametrize(
    "raw,want",
    [("12", 12), (" 7 ", 7), ("1k", 1 << 10), ("3M", 3 << 20), ("2GiB", 2 << 30), ("1tb", 1 << 40), ("0", 0)],
)
def test_sizes_with_units(raw, want, monkeypatch):
    monkeypatch.setenv("FIMOE_TEST_INT", raw)
    assert env.env_int("FIMOE_TEST_INT", 5, units=True) == want


@pytest.mark.parametrize("raw", ["-1", "1.5", "x", "1e9", "0x10", "9" * 40, "12 34", "5P"])
def test_bad_integers(raw, monkeypatch):
    monkeypatch.setenv("FIMOE_TEST_INT", raw)
    with pytest.raises(FimoeError, match="FIMOE_TEST_INT=.* is not a whole number"):
        env.env_int("FIMOE_TEST_INT", 5, units=True)


def _install_log(value: str | None, monkeypatch, caplog) -> list[str]:
    """What the vLLM plugin logs with ``FIMOE_LAB_INSTALL=value`` (vLLM is not installed here: an attempt
    to install is logged as not installed)."""
    if value is None:
        monkeypatch.delenv("FIMOE_LAB_INSTALL", raising=False)
    else:
        monkeypatch.setenv("FIMOE_LAB_INSTALL", value)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fimoe_lab.integrations"):
        vllm.INTEGRATION.install_from_env()
    assert not vllm.INTEGRATION.is_installed
    return [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("value", [None, *env.FALSE, "OFF", " Off ", "No"])
def test_a_false_install_value_never_tries_to_install(value, monkeypatch, caplog):
    assert _install_log(value, monkeypatch, caplog) == []


@pytest.mark.parametrize("value", [*env.TRUE, "force", "FORCE"])
def test_a_true_install_value_tries_to_install(value, monkeypatch, caplog):
    logged = _install_log(value, monkeypatch, caplog)
    assert len(logged) == 1 and "not installed into vllm" in logged[0], logged


@pytest.mark.parametrize("value", ["enable", "forced", "2", "offf"])
def test_a_bad_install_value_is_one_warning_and_nothing_installed(value, monkeypatch, caplog):
    logged = _install_log(value, monkeypatch, caplog)
    assert len(logged) == 1 and "FIMOE_LAB_INSTALL" in logged[0] and "is not a boolean" in logged[0], logged


CLI_CASES = {
    "write-lanes-word": ("FIMOE_WRITE_LANES", "many"),
    "write-lanes-zero": ("FIMOE_WRITE_LANES", "0"),
    "write-lanes-huge": ("FIMOE_WRITE_LANES", "100000"),
    "background-word": ("FIMOE_BACKGROUND_LOAD", "sometimes"),
    "inplace-clusters-word": ("FIMOE_INPLACE_CLUSTERS", "maybe"),
    "cache-bytes-word": ("FIMOE_LAB_CACHE_BYTES", "lots"),
    "cache-bytes-negative": ("FIMOE_LAB_CACHE_BYTES", "-5"),
    "install-typo": ("FIMOE_LAB_INSTALL", "offf"),
    "max-memory-word": ("FIMOE_LAB_MAX_MEMORY", "plenty"),
    "max-memory-fraction": ("FIMOE_LAB_MAX_MEMORY", "1.5G"),
    "dist-timeout-zero": ("FIMOE_DIST_TIMEOUT", "0"),
    "dist-data-timeout-empty": ("FIMOE_DIST_DATA_TIMEOUT", ""),
}


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_a_bad_environment_value_is_one_line_and_writes_nothing(case, tmp_path, capsys, monkeypatch):
    from fimoe_lab import caches

    monkeypatch.setattr(caches, "_budget", None)  # read from the environment again
    name, value = CLI_CASES[case]
    monkeypatch.setenv(name, value)
    ck = copy_sample("mixtral-bf16", tmp_path)
    out = tmp_path / "k.safetensors"
    rc, _, err = run(["convert", ck, out, "--backend", BACKEND, "--no-progress"], capsys)
    monkeypatch.delenv(name)
    monkeypatch.setattr(caches, "_budget", None)
    assert rc == 2, err
    (line,) = error_after_progress(err, during=False)
    assert f"{name}={value!r}" in line and f"unset {name}" in line, line
    assert leftovers(out) == []
