"""Every ``distro_opt.*`` name that a warning or a page of the docs tells a user to use exists: a
warning that names a function that is not there sends the user nowhere."""
import importlib
import pathlib
import re

import pytest

from distro_opt.wrappers import warning_text

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOTTED = re.compile(r"\bdistro_opt(?:\.[A-Za-z_][A-Za-z0-9_]*)+")


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):  # the longest importable module, then attributes
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _names(text: str) -> set[str]:
    return {m.group(0).rstrip(".") for m in DOTTED.finditer(text)}


def test_the_ddp_warning_names_functions_that_exist():
    names = _names(warning_text(["DistributedDataParallel"], "DisTrOAdamW"))
    assert "distro_opt.integrations.accelerate.without_ddp" in names
    assert [n for n in names if not _resolves(n)] == []


@pytest.mark.parametrize("page", sorted(p.relative_to(ROOT).as_posix() for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]))
def test_every_distro_opt_name_a_page_mentions_exists(page):
    text = (ROOT / page).read_text()
    assert [n for n in sorted(_names(text)) if not _resolves(n)] == []
