"""The docs say what the code has: the API reference lists every public name, the architecture
page's NOTE table is the code's (docs/_ext/note_table.py writes it), and no page cites a NOTE that
does not exist. (The pages' code blocks run in test_readme.py; ``mkdocs build --strict`` in ``tox -e lint``
checks links and the API reference's references.)"""

from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest

import hyperac

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]

_CITED = re.compile(r"NOTE \[(?P<title>[^\]]+)\]")


def _load(path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


note_table = _load(DOCS / "_ext" / "note_table.py")


def test_the_api_page_lists_every_public_name():
    listed = re.findall(r"^::: hyperac\.(\w+)$", (DOCS / "api.md").read_text(encoding="utf-8"), re.MULTILINE)
    assert sorted(listed) == sorted(set(listed)), "a name is listed twice"
    missing, extra = sorted(set(hyperac.__all__) - set(listed)), sorted(set(listed) - set(hyperac.__all__))
    assert not missing, f"add a '::: hyperac.NAME' line to docs/api.md for each of {missing}"
    assert not extra, f"docs/api.md lists {extra}, which hyperac.__all__ does not export"


def test_every_public_name_has_a_docstring():
    missing = [name for name in hyperac.__all__ if not (getattr(hyperac, name).__doc__ or "").strip()]
    assert not missing


def test_the_architecture_table_lists_every_note_where_it_is_defined():
    defined = note_table.definitions()
    assert not {title: files for title, files in defined.items() if len(files) > 1}, "a NOTE title defined twice"
    assert len(defined) >= 40
    assert note_table.page_table() == note_table.table(), \
        "docs/architecture.md's NOTE table differs from the code's: run python docs/_ext/note_table.py"


@pytest.mark.parametrize("page", PAGES, ids=lambda path: path.relative_to(ROOT).as_posix())
def test_every_cited_note_exists(page):
    definitions = note_table.definitions()
    cited = {" ".join(title.split()) for title in _CITED.findall(page.read_text(encoding="utf-8"))}  # wrapped lines
    assert not cited - set(definitions), f"{page.name} cites NOTEs that no code defines"


def test_the_version_agrees_with_pyproject_and_the_changelog():
    """The version policy (CHANGELOG.md) keeps the two copies of the version equal, with an entry."""
    declared = re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(encoding="utf-8"), re.MULTILINE)
    assert declared is not None and declared[1] == hyperac.__version__
    assert f"## [{hyperac.__version__}]" in (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub and MkDocs' default toc both make it (for the headings used here)."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return re.sub(r"[ -]+", "-", text).strip("-")


@pytest.mark.parametrize("page", [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md"],
                         ids=lambda path: path.name)
def test_links_outside_the_site_reach_a_page_and_its_heading(page):
    """README.md and the other root pages are not built by mkdocs, whose --strict checks the site's links."""
    for target, anchor in re.findall(r"\]\((?!https?://)([^)#\s]+)(?:#([^)\s]+))?\)", page.read_text(encoding="utf-8")):
        path = (page.parent / target).resolve()
        assert path.is_file(), f"{page.name} links to {target}, which does not exist"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", path.read_text(encoding="utf-8"), re.MULTILINE)
            assert anchor in {_slug(h) for h in headings}, f"{page.name} links to {target}#{anchor}: no such heading"


_INSTALLED_BY = {"transformers": "[hf]", "accelerate": "[hf]", "matplotlib": "[plot]", "peft": "peft", "trl": "trl"}
"""What a page's install line names for a package its code imports: the extra that brings it
(pyproject.toml), or the package itself where no extra a user installs has it."""
_IMPORTED = re.compile(r"^\s*(?:from|import)\s+(\w+)", re.MULTILINE)


@pytest.mark.parametrize("page", PAGES, ids=lambda path: path.relative_to(ROOT).as_posix())
def test_a_page_says_how_to_install_what_its_code_imports(page):
    """A page whose code imports transformers, accelerate, matplotlib, PEFT or TRL has a ``pip install``
    line naming the extra that brings it, or the package where no extra does."""
    text = page.read_text(encoding="utf-8")
    code = "\n".join(re.findall(r"^```python\n(.*?)^```$", text, re.MULTILINE | re.DOTALL))
    needed = {_INSTALLED_BY[name] for name in _IMPORTED.findall(code) if name in _INSTALLED_BY}
    installs = [line for line in text.splitlines() if "pip install" in line]
    missing = sorted(token for token in needed if not any(token in line for line in installs))
    assert not missing, f"{page.relative_to(ROOT)}: add an install line naming {missing} (e.g. pip install \".[hf]\")"
