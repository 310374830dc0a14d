"""Write ``tests/npu_schemas.json``: every ``npu::`` op schema a torch_npu wheel registers, with its tags.

The NPU tests cannot install ``torch_npu`` (without Ascend CANN it breaks ``import torch``), so they
register stand-ins of its ops with ``torch.library``. This script takes the stand-ins' schemas and
tags from the real wheel, so that a stand-in is called, dispatched and classified as torch_npu's op
would be::

    pip download --no-deps --only-binary=:all: --python-version 3.11 \\
        --platform manylinux_2_28_x86_64 torch-npu==2.14.0 -d /tmp/npuwheel
    python scripts/npu_schemas.py /tmp/npuwheel/torch_npu-2.14.0-*.whl    # writes tests/npu_schemas.json

Never ``pip install`` the wheel here; the script only reads it as a zip file.

Where the schemas come from (torch_npu 2.14.0):

* ``torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml``, section ``custom``: the C++ ops.
  torch_npu's own code generator (``torchnpugen/custom_functions.py``, ``RegisterCustomSchema``)
  turns each entry into ``m.def(schema, tags)`` inside ``TORCH_LIBRARY(npu, m)``, after two rewrites
  this script repeats: an argument named ``self`` is renamed ``input``, and an overload with several
  ``out`` tensors takes them as one ``Tensor[] out``. Tags are the entry's ``tags`` key.
* ``torch.library.Library("npu", "FRAGMENT").define(...)`` calls in the package's Python files (a few
  graph-capture helpers that take no tensor or return nothing).

Every rewritten C++ schema is then looked for, verbatim, among the strings of
``torch_npu/lib/libtorch_npu.so``: the script fails if one is missing, so the file holds the text
torch_npu passes to the dispatcher, not a guess at it. The file lists each overload once, sorted.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import zipfile
from pathlib import Path

import yaml

YAML_PATH = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
LIBRARY_PATH = "torch_npu/lib/libtorch_npu.so"
OUTPUT = Path(__file__).resolve().parent.parent / "tests" / "npu_schemas.json"

_SELF = re.compile(r"\bself\b(?=[,\)])")
_DECLARATION = re.compile(r"(?P<name>[^\(]+)\((?P<args>.*)\) -> (?P<returns>.*)")
_PYTHON_DEFINE = re.compile(r"""\.define\(\s*["']([^"']+)["']""")
_NPU_FRAGMENT = re.compile(r"""Library\(\s*["']npu["']\s*,\s*["']FRAGMENT["']""")


def registered_schema(func: str, out_count: int) -> str:
    """The schema string torch_npu's ``RegisterCustomSchema`` passes to ``m.def`` for ``func``."""
    if out_count > 1:
        name, args, _ = _DECLARATION.findall(func)[0]
        returns = ", ".join(["Tensor"] * out_count)
        func = f"{name}({','.join(args.split(',')[:-out_count])}, Tensor[] out) -> ({returns})"
    return _SELF.sub("input", func)


def out_count(func: str) -> int:
    """How many ``out`` arguments (keyword-only, written: ``Tensor(a!) name``) ``func`` has."""
    arguments = _DECLARATION.findall(func)[0][1]
    keyword_only = arguments.partition("*")[2] if "*" in arguments else ""
    return len(re.findall(r"Tensor\([a-z]!\)", keyword_only))


def read_wheel(wheel: Path) -> dict:
    with zipfile.ZipFile(wheel) as archive:
        version = next(name for name in archive.namelist() if name.endswith(".dist-info/METADATA"))
        version = re.search(r"^Version: (.+)$", archive.read(version).decode(), re.MULTILINE).group(1)
        functions = yaml.safe_load(archive.read(YAML_PATH))
        library = archive.read(LIBRARY_PATH)
        python_sources = {name: archive.read(name).decode() for name in archive.namelist()
                          if name.startswith("torch_npu/") and name.endswith(".py")}
    ops: dict[str, dict] = {}
    missing = []
    for entry in functions["custom"]:
        schema = registered_schema(entry["func"], out_count(entry["func"]))
        if schema.encode() + b"\0" not in library:
            missing.append(schema)
        tags = entry.get("tags", [])
        ops[schema.partition("(")[0]] = {"schema": schema, "tags": sorted([tags] if isinstance(tags, str) else tags),
                                         "source": YAML_PATH}
    if missing:
        raise SystemExit(f"{len(missing)} generated schemas are not in {LIBRARY_PATH}, e.g. {missing[0]!r}: "
                         "torch_npu's code generator changed; update registered_schema().")
    for name, source in sorted(python_sources.items()):
        if _NPU_FRAGMENT.search(source):
            for schema in _PYTHON_DEFINE.findall(source):
                ops.setdefault(schema.partition("(")[0], {"schema": schema, "tags": [], "source": name})
    return {"torch_npu": version, "ops": [ops[name] for name in sorted(ops)]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("wheel", type=Path, help="a downloaded torch_npu wheel (never installed)")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
    table = read_wheel(args.wheel)
    args.output.write_text(json.dumps(table, indent=1) + "\n")
    print(f"{len(table['ops'])} npu:: schemas of torch_npu {table['torch_npu']} -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
