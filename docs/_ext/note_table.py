"""The table of NOTE blocks on docs/architecture.md, generated from the code.

``python docs/_ext/note_table.py`` rewrites the table after a NOTE is added, renamed or moved;
``tests/test_docs.py`` fails while the page's table differs from the code's.
"""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "architecture.md"
HEADER = "| NOTE | defined in |\n|---|---|\n"

# A NOTE's definition opens a line (of a comment or a docstring); a citation of it sits inside text,
# or reads "NOTE [Title] in other_file.py".
DEFINITION = re.compile(r"^\s*(?:#\s*)?NOTE \[(?P<title>[^\]]+)\](?! in )", re.MULTILINE)


def definitions() -> dict[str, list[str]]:
    """Each NOTE title, with the files that define it (one, unless a title is reused by mistake)."""
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "hyperac").rglob("*.py")):
        for match in DEFINITION.finditer(path.read_text(encoding="utf-8")):
            found.setdefault(match["title"], []).append(path.relative_to(ROOT).as_posix())
    return found


def table() -> str:
    """The table's rows, by file, then title."""
    rows = sorted(((files[0], title) for title, files in definitions().items()))
    return "".join(f"| {title} | `{path}` |\n" for path, title in rows)


def page_table() -> str:
    """The rows the page holds now (the table ends the page)."""
    text = PAGE.read_text(encoding="utf-8")
    return text[text.index(HEADER) + len(HEADER):]


def main() -> None:
    text = PAGE.read_text(encoding="utf-8")
    PAGE.write_text(text[: text.index(HEADER) + len(HEADER)] + table(), encoding="utf-8")


if __name__ == "__main__":
    main()
