"""Every fenced ```python block of README.md, CONTRIBUTING.md and the docs site (docs/) runs as
written, on the CPU.

Each block runs in a fresh namespace (nothing from another block, nothing from the tests), all
of them in one child process started in an empty directory, so what a block registers or writes
(an adapter, a backend, ``plan.json``) stays out of this process. A block that cannot run here
(it needs a GPU, several processes or a package outside the CPU env) has the line
``<!-- readme-test: skip (reason) -->`` right above its fence, and the reason names where it runs.
"""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys
from typing import NamedTuple

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
_SKIP = re.compile(r"^<!-- readme-test: skip \((?P<reason>[^)]+)\) -->$")


class Block(NamedTuple):
    name: str  # the page, the section it is in, and its place there: "docs/modes.md:per-layer-plans-1"
    line: int  # of the opening fence, 1-based
    code: str
    skip: str | None
    page: str = "README.md"


def readme_blocks(text: str, page: str = "README.md") -> list[Block]:
    blocks: list[Block] = []
    section, count = "top", 0
    lines = text.splitlines()
    position = 0
    while position < len(lines):
        line = lines[position]
        if line.startswith("#"):
            section, count = re.sub(r"[^a-z0-9]+", "-", line.lstrip("#").strip().lower()).strip("-"), 0
        if line.startswith("```"):
            end = lines.index("```", position + 1)
            if line == "```python":
                count += 1
                marker = _SKIP.match(lines[position - 1]) if position else None
                code = "\n".join(lines[position + 1:end]) + "\n"
                blocks.append(Block(f"{page}:{section}-{count}", position + 1, code, marker and marker["reason"], page))
            position = end
        position += 1
    return blocks


def _relative(path: pathlib.Path) -> str:
    return path.relative_to(ROOT).as_posix()


BLOCKS = [block for path in PAGES for block in readme_blocks(path.read_text(encoding="utf-8"), _relative(path))]

# Runs in the child: each block in a fresh namespace, its stdout kept, its error as a traceback.
_RUNNER = r"""
import contextlib, io, json, sys, traceback
import torch
torch.set_num_threads(1)
results = []
for name, page, line, code in json.load(sys.stdin):
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile("\n" * (line) + code, page, "exec"), {"__name__": "__readme__"})
        error = None
    except BaseException:
        error = traceback.format_exc(limit=-4)
    results.append({"name": name, "stdout": out.getvalue(), "error": error})
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    runnable = [(b.name, b.page, b.line, b.code) for b in BLOCKS if b.skip is None]
    process = subprocess.run(
        [sys.executable, "-c", _RUNNER], input=json.dumps(runnable), capture_output=True, text=True,
        cwd=tmp_path_factory.mktemp("readme"), check=False,
    )
    assert process.returncode == 0, process.stderr[-3000:]
    return {result["name"]: result for result in json.loads(process.stdout.splitlines()[-1])}


@pytest.mark.parametrize("block", BLOCKS, ids=[b.name for b in BLOCKS])
def test_block_runs_as_written(block, results):
    if block.skip is not None:
        pytest.skip(f"{block.page}:{block.line}: {block.skip}")
    assert results[block.name]["error"] is None, f"{block.page}:{block.line}\n{results[block.name]['error']}"


def test_recompute_mismatch_example_raises(results):
    """The correctness page's stateful layer really raises RecomputeMismatchError (the block prints it)."""
    (name,) = [b.name for b in BLOCKS if b.page == "docs/correctness.md" and "RecomputeMismatch" in b.code]
    assert "diverged from its forward" in results[name]["stdout"], results[name]


def test_input_written_example_raises(results):
    """The correctness page's layer writing its input really raises InputWrittenError (the block prints it)."""
    (name,) = [b.name for b in BLOCKS if b.page == "docs/correctness.md" and "InputWrittenError" in b.code]
    assert "was written in place" in results[name]["stdout"], results[name]


@pytest.mark.parametrize("path", PAGES, ids=_relative)
def test_skip_markers_give_a_reason_and_sit_on_a_fence(path):
    text = path.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(text):
        if line.startswith("<!--") and "readme-test" in line:  # a marker; prose may name it in backticks
            assert _SKIP.match(line), f"{_relative(path)}:{number + 1}: malformed marker {line!r}"
            assert text[number + 1] == "```python", \
                f"{_relative(path)}:{number + 1}: the marker is not above a python fence"


@pytest.mark.parametrize("path", PAGES, ids=_relative)
def test_every_block_is_found(path):
    fences = sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line == "```python")
    assert len([b for b in BLOCKS if b.page == _relative(path)]) == fences


def test_the_pages_hold_the_examples():
    """README.md keeps its examples, and the docs hold the ones it used to carry."""
    pages = {b.page for b in BLOCKS}
    assert {"README.md", "docs/auto.md", "docs/correctness.md", "docs/modes.md", "docs/swap.md"} <= pages
    assert len(BLOCKS) >= 20
