"""Configuration: every MCRDL_* variable is declared once (mcrdl_core.base.config), parsed
strictly, and the README's table is the one generated from the declarations."""
import re
from pathlib import Path

import pytest

from mcrdl_core.base import config
from mcrdl_core.base.errors import InvalidArgumentError

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [p for d in ("mcrdl_core", "backends", "frontends") for p in (ROOT / d).rglob("*.py")]


def test_readme_table_is_generated_from_the_declarations():
    text = (ROOT / "README.md").read_text()
    table = re.search(r"<!-- config-table:start -->\n(.*?)\n<!-- config-table:end -->", text, re.S)
    assert table, "README.md has no config-table markers"
    assert table.group(1).strip() == config.markdown_table(), (
        "README's configuration table differs from mcrdl_core.base.config: regenerate it with "
        "`python -m mcrdl_core.base.config`")


def test_every_variable_the_code_names_is_declared():
    named = set()
    for p in SOURCES:
        named |= set(re.findall(r"\bMCRDL_[A-Z0-9_]*[A-Z0-9]\b", p.read_text()))
    assert named - set(config.VARS) == set(), "declare these in mcrdl_core/base/config.py"


def test_no_module_reads_an_mcrdl_variable_from_the_environment_itself():
    direct = re.compile(r"(os\.environ(\.get)?|os\.getenv)\s*[\[(]\s*[\"']MCRDL_")
    offenders = [str(p.relative_to(ROOT)) for p in SOURCES
                 if p.name != "config.py" and direct.search(p.read_text())]
    assert offenders == [], "read MCRDL_* through mcrdl_core.base.config.get"


@pytest.mark.parametrize("text,value", [("on", True), ("1", True), ("Yes", True), ("off", False),
                                        ("0", False), ("false", False)])
def test_booleans_parse_one_way(monkeypatch, text, value):
    monkeypatch.setenv("MCRDL_COMM_LOG", text)
    assert config.get("MCRDL_COMM_LOG") is value


@pytest.mark.parametrize("name,text", [("MCRDL_COMM_LOG", "maybe"), ("MCRDL_TIMEOUT", "soon"),
                                       ("MCRDL_TIMEOUT", "-1"), ("MCRDL_BOOTSTRAP", "slurm"),
                                       ("MCRDL_COMPRESSION_CHUNKS", "0")])
def test_bad_values_name_the_variable_and_what_it_accepts(monkeypatch, name, text):
    monkeypatch.setenv(name, text)
    with pytest.raises(InvalidArgumentError, match=rf"{name}='{re.escape(text)}' is not valid: use"):
        config.get(name)


def test_unset_and_empty_give_the_default(monkeypatch):
    monkeypatch.delenv("MCRDL_TIMEOUT", raising=False)
    assert config.get("MCRDL_TIMEOUT") == 300.0
    monkeypatch.setenv("MCRDL_TIMEOUT", " ")
    assert config.get("MCRDL_TIMEOUT") == 300.0
    with pytest.raises(KeyError):
        config.get("MCRDL_NOT_A_VARIABLE")


def test_public_names_the_docs_tell_users_to_use():
    """The README and docs tell users to catch these and call these."""
    import mcrdl_core

    for name in ("BrokenGroupError", "CommFailedError", "CommTimeoutError", "MismatchError",
                 "P2POp", "batch_isend_irecv", "stragglers", "stale_ranks"):
        assert hasattr(mcrdl_core, name), name
