"""The ``hyperac`` command line: ``demo`` and ``plan``, and its error paths.

The slow commands run once each (module fixture ``runs``) and the error paths, through
:func:`hyperac.cli.main` in this process (transformers is imported once); a few error paths also
run as processes, for the exit status and stderr of the real entry points.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import pathlib
import re
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
from hyperac_testing import tiny_blocks_model

from hyperac import cli, demo

MODULE = [sys.executable, "-m", "hyperac.cli"]
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
TINY_LLAMA = dict(
    model_type="llama", num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=128, max_position_embeddings=128,
)
WIDE_LLAMA = {**TINY_LLAMA, "num_hidden_layers": 3, "hidden_size": 256, "intermediate_size": 512,
              "max_position_embeddings": 2048}
"""At seq 2048 in bfloat16 a layer input is 1 MiB, the default ``min_swap_bytes``: swap has something to move."""
PLAN_ROW = (r"^\s*{index}\s+model\.layers\.{index}\s+(off|pointwise|selective|selective-even|full|swap)\s+"
            r"(-|([\d.]+) MiB, ([\d.]+) ms exposed)\s*$")
TINY_DEMO = ["--rounds", "3", "--layers", "2", "--hidden", "64", "--seq", "32"]


def installed_script():
    """The ``hyperac`` console script next to this interpreter, else ``python -m hyperac.cli``."""
    script = shutil.which("hyperac", path=str(pathlib.Path(sys.executable).parent))
    return [script] if script else MODULE


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli")
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    (folder / "no_type.json").write_text(json.dumps({k: v for k, v in TINY_LLAMA.items() if k != "model_type"}))
    (folder / "unknown_type.json").write_text(json.dumps({**TINY_LLAMA, "model_type": "no-such-model"}))
    (folder / "not_json.json").write_text("model_type: llama\n")
    return folder


def main_captured(argv):
    """``hyperac ARGV`` in this process: ``(exit code, stdout, stderr)``, warnings printed to stderr as a
    process would print them (every one, not once per place)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        code = cli.main(argv)
    printed = "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno) for w in seen)
    return code, out.getvalue(), err.getvalue() + printed


@pytest.fixture(scope="module")
def runs(files):
    """Every command below once, as ``{name: (exit code, stdout, stderr)}``: the slow ones in this process
    (transformers is imported once; a process would import it again, 3.5 s of CPU each), the error
    paths also as real processes, for the exit status and stderr of the entry points."""
    results = {
        "demo": main_captured(["demo", *TINY_DEMO]),
        "preset": main_captured(["plan", "--preset", "llama-3-8b", "--seq", "512", "--budget", "0.5"]),
        "config": main_captured(["plan", "--config", str(files / "config.json"), "--seq", "64", "--budget", "0.7"]),
    }
    processes = {
        "unknown_preset": [*installed_script(), "plan", "--preset", "llama-9", "--budget", "0.5"],
        "no_budget": [*MODULE, "plan", "--preset", "llama-3-8b"],
    }
    for name, command in processes.items():
        process = subprocess.run(command, capture_output=True, cwd=files, text=True, check=False)
        results[name] = (process.returncode, process.stdout, process.stderr)
    return results


def assert_one_error_line(code, stderr, pattern, clean=True):
    """Exit status 2; exactly one stderr line starts with 'hyperac:', it is the last one and matches
    ``pattern``; no traceback. ``clean``: nothing else on stderr."""
    lines = stderr.strip().splitlines()
    assert code == 2, stderr
    assert "Traceback" not in stderr, stderr
    errors = [line for line in lines if line.startswith("hyperac:")]
    assert len(errors) == 1 and lines[-1] == errors[0], stderr
    assert re.search(pattern, errors[0]), errors[0]
    if clean:
        assert lines == errors, stderr


# ---------------------------------------------------------------------------------------------
# hyperac demo


def demo_rows(stdout):
    """``{label: (peak MiB, recompute FLOPs %, step ms, x off, loss+grads == off, plan)}`` of every table row."""
    row = re.compile(r"^(\S.*?)\s+([\d.]+)\s+(-?[\d.]+)%\s+([\d.]+)\s+([\d.]+)\s+(yes|NO)\s*([oFspe]*)$", re.M)
    return {found[1]: (float(found[2]), float(found[3]), float(found[4]), float(found[5]), found[6], found[7])
            for found in row.finditer(stdout)}


def test_demo_prints_the_comparison_table(runs):
    code, stdout, stderr = runs["demo"]
    assert code == 0, stdout + stderr
    assert ("hyperac demo: tiny Llama, 2 layers, hidden 64, batch 2 x seq 32; CPU, 1 thread, 3 interleaved rounds"
            in stdout)
    assert "loss+grads == off" in stdout
    rows = demo_rows(stdout)
    assert list(rows) == ["off", "full", "selective", "auto 50%"], stdout
    assert all(row[4] == "yes" for row in rows.values()), stdout
    assert rows["off"][1] == 0.0 and rows["off"][3] == 1.0  # x off: the median of per-round ratios to off
    assert all(row[2] > 0 and row[3] > 0 for row in rows.values())
    assert rows["full"][1] > rows["selective"][1] > 0
    assert rows["off"][0] > rows["selective"][0] > rows["full"][0] > 0
    assert rows["auto 50%"][0] <= 0.515 * rows["off"][0]  # auto's measured peak fits half of off's
    assert re.fullmatch(r"[oFspe]{2}", rows["auto 50%"][5]), stdout  # and it says which plan it chose
    assert all(row[5] == "" for label, row in rows.items() if label != "auto 50%")
    assert "peak MiB: the most activation memory alive at once over forward and backward" in stdout
    assert "x off: median of the per-round ratios to off" in stdout
    assert "[4/4] auto" in stderr
    assert "timing 3 rounds of 4 configurations, interleaved" in stderr


def test_demo_emits_no_planner_warning(runs):
    code, _, stderr = runs["demo"]
    assert code == 0
    assert "HyperACWarning" not in stderr, stderr


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib is not installed")
def test_demo_plot(files, capsys, monkeypatch):
    """--plot draws every configuration it measured: hyperac's modes, auto's plans, every-n plans
    and each peer, timed in the same rounds; the caller's thread count is restored."""
    from matplotlib.figure import Figure

    figures = []
    savefig = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda figure, *a, **k: (figures.append(figure), savefig(figure, *a, **k)))
    image = files / "plot.png"
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        code = cli.main(["demo", *TINY_DEMO, "--plot", str(image)])
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    assert f"wrote {image}" in stdout
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = demo_rows(stdout)
    budgets = (demo.DEMO_BUDGET, *demo.SWEEP_BUDGETS)
    drawn = [*demo.PEERS, "full every 2", "full every 3", *(f"auto {budget:.0%}" for budget in budgets)]
    assert set(rows) == {"off", "full", "selective", *drawn}, stdout
    assert all(rows[label][4] == "yes" for label in rows if label not in demo.PEERS), stdout
    assert rows["full every 2"][5] == "Fo" and rows["HF checkpointing"][0] == rows["full"][0]
    [figure] = figures
    legend = [text.get_text() for text in figure.axes[0].get_legend().get_texts()]
    assert set(demo.PEERS) <= set(legend), legend
    assert {"hyperac off", "hyperac full", "hyperac selective", "hyperac full every 2 (Fo)"} <= set(legend), legend
    assert any(text.startswith("hyperac auto, budget 50%-90%") for text in legend), legend
    [auto] = [line for line in figure.axes[0].get_lines() if line.get_label().startswith("hyperac auto")]
    assert len(auto.get_xdata()) == 1 + len(demo.SWEEP_BUDGETS)
    assert list(auto.get_xdata()) == pytest.approx([rows[f"auto {budget:.0%}"][0] for budget in budgets], abs=0.01)


def test_demo_leaves_out_a_peer_it_cannot_apply_with_a_note():
    """A model without HF's activation_checkpointing_enable: the HF peers are noted, not drawn."""
    notes = []
    points = demo._peers(tiny_blocks_model(), notes)
    assert set(points) == {"torchtitan full", "torchtitan selective"}
    assert [note.split(":")[0] for note in notes] == ["HF checkpointing", "HF checkpointing every 2"]
    assert all("not drawn: TinyBlocksModel has no activation_checkpointing_enable()" in note for note in notes)


# ---------------------------------------------------------------------------------------------
# hyperac plan


def check_plan_output(stdout, layers):
    for index in range(layers):
        assert re.search(PLAN_ROW.format(index=index), stdout, re.M), f"no plan row for layer {index}\n{stdout}"
    assert re.search(rf"^\s*{layers}\s+model\.layers\.{layers}\s", stdout, re.M) is None
    for mode in ("off", "pointwise", "selective", "full"):
        assert f"all {mode}" in stdout  # the estimate table
    assert re.search(r"^plan for a budget of [\d.]+ GiB:$", stdout, re.M), stdout
    predicted = re.search(r"^predicted: peak ([\d.]+) GiB \(no recompute: ([\d.]+) GiB\), .* ([\d.]+)"
                          r" TFLOP replayed \(([\d.]+)% of the step\)$", stdout, re.M)
    assert predicted, stdout
    return [float(value) for value in predicted.groups()]


def plan_rows(stdout, layers):
    """Per layer: (mode, MiB swapped to host or None, ms of copy time exposed or None)."""
    rows = []
    for index in range(layers):
        found = re.search(PLAN_ROW.format(index=index), stdout, re.M)
        swapped = found.group(3) is not None
        rows.append((found.group(1), float(found.group(3)) if swapped else None,
                     float(found.group(4)) if swapped else None))
    return rows


def swap_line(stdout):
    """``(layers, GiB moved, ms exposed, GiB pinned, GiB host budget)`` from the swap summary line."""
    found = re.search(r"^swap: (\d+) layers move ([\d.]+) GiB to host at \d+ GB/s, ([\d.]+) ms of copies exposed; "
                      r"pinned host ([\d.]+) GiB of a ([\d.]+) GiB host budget$", stdout, re.M)
    assert found, stdout
    return int(found.group(1)), *(float(value) for value in found.groups()[1:])


def test_plan_preset(runs):
    code, stdout, stderr = runs["preset"]
    assert code == 0, stderr
    assert "estimating llama, 32 layers, batch 1 x seq 512, bfloat16, on the meta device" in stderr
    kept, off, _, _ = check_plan_output(stdout, 32)
    budget = float(re.search(r"plan for a budget of ([\d.]+) GiB", stdout).group(1))
    assert kept <= budget + 0.01 and budget == pytest.approx(0.5 * off, abs=0.01)


def test_plan_preset_swaps_on_an_accelerator(runs):
    """On h100 (the default profile) a 4 MiB layer input and a 64 GB/s host link make swap the
    cheaper way to fit: rows say what each swapping layer moves and the copy time not hidden."""
    code, stdout, _ = runs["preset"]
    assert code == 0
    rows = plan_rows(stdout, 32)
    swapped = [(mib, ms) for _, mib, ms in rows if mib is not None]
    assert swapped and all(mib > 0 and ms >= 0 for mib, ms in swapped), stdout
    assert rows[-1][1] is None  # the last layer's backward comes first: it never offloads
    layers, moved, exposed, pinned, host_budget = swap_line(stdout)
    assert layers == len(swapped) and moved == pytest.approx(sum(mib for mib, _ in swapped) / 1024, abs=0.01)
    assert exposed == pytest.approx(sum(ms for _, ms in swapped), abs=0.01 * layers)
    assert moved <= pinned <= host_budget


@pytest.fixture(scope="module")
def wide_plans(files):
    """``hyperac plan`` on a wide 3-layer Llama at budget 0.7 on h100, by default (writing
    ``wide_plan.json``), with --no-swap, with --device cpu and with a small --host-budget, as
    ``{name: (code, stdout, stderr)}``."""
    (files / "wide.json").write_text(json.dumps(WIDE_LLAMA))
    base = ["plan", "--config", str(files / "wide.json"), "--seq", "2048", "--budget", "0.7"]
    variants = {"h100": ["--output", str(files / "wide_plan.json")], "no_swap": ["--no-swap"],
                "cpu": ["--device", "cpu"], "host": ["--host-budget", "8MiB"],
                "small_min": ["--min-swap-bytes", "0"], "big_min": ["--min-swap-bytes", "1GiB"]}
    return {name: main_captured([*base, *extra]) for name, extra in variants.items()}


def test_plan_swap_is_offered_on_accelerators_only(wide_plans):
    code, stdout, stderr = wide_plans["h100"]
    assert code == 0, stderr
    rows = plan_rows(stdout, 3)
    assert any(mib for _, mib, _ in rows), stdout
    assert swap_line(stdout)[0] >= 1
    for name, why in (("no_swap", "--no-swap"), ("cpu", "the cpu profile has no host link")):
        code, stdout, stderr = wide_plans[name]
        assert code == 0, stderr
        assert all(mib is None and mode != "swap" for mode, mib, _ in plan_rows(stdout, 3)), stdout
        assert f"swap: not offered ({why})" in stdout


def test_plan_table_is_the_plan_file(wide_plans, files):
    """The printed plan is the one --output writes: each row's mode and whether it swaps to host are the
    file's layer's, the swap chain's last layer included (a ``swap`` that keeps its tensors: the solver
    chose ``off`` there), and the summary counts the file's swapping layers."""
    code, stdout, stderr = wide_plans["h100"]
    assert code == 0, stderr
    written = json.loads((files / "wide_plan.json").read_text())["layers"]
    printed = [(mode, mib is not None) for mode, mib, _ in plan_rows(stdout, 3)]
    assert printed == [(layer["mode"], layer["swap"]) for layer in written], stdout
    assert printed[-1] == ("swap", False)
    assert swap_line(stdout)[0] == sum(layer["swap"] for layer in written)
    assert "note: a swap layer that moves nothing (-) is the last of the swap chain" in stdout


def test_plan_host_budget_bounds_the_pinned_bytes(wide_plans):
    unbounded = swap_line(wide_plans["h100"][1])
    code, stdout, stderr = wide_plans["host"]
    assert code == 0, stderr
    _, _, _, pinned, host_budget = swap_line(stdout)
    assert host_budget == pytest.approx(8 / 1024, abs=0.005) and pinned <= host_budget < unbounded[3]


def test_plan_min_swap_bytes_sets_what_a_swap_may_move(wide_plans):
    """--min-swap-bytes reads as min_swap_bytes= does: at 1 GiB no storage of this model qualifies
    and nothing swaps; at 0 every saved tensor may go, so a layer's swap moves at least as much as
    under the 1 MiB default."""
    code, stdout, stderr = wide_plans["big_min"]
    assert code == 0, stderr
    assert all(mib is None for _, mib, _ in plan_rows(stdout, 3)) and swap_line(stdout)[0] == 0, stdout
    code, stdout, stderr = wide_plans["small_min"]
    assert code == 0, stderr
    assert swap_line(stdout)[0] >= 1
    most = max(mib or 0 for _, mib, _ in plan_rows(stdout, 3))
    assert most >= max(mib or 0 for _, mib, _ in plan_rows(wide_plans["h100"][1], 3))


def table_total(stdout, mode):
    return float(re.search(rf"^all {mode}\s+peak\s+([\d.]+) MiB", stdout, re.M).group(1))


def test_plan_preset_half_budget_is_feasible(runs):
    code, stdout, _ = runs["preset"]
    assert code == 0
    assert table_total(stdout, "full") < 0.5 * table_total(stdout, "off")


def test_plan_local_config(runs):
    code, stdout, stderr = runs["config"]
    assert code == 0, stderr
    assert "estimating llama, 2 layers, batch 1 x seq 64" in stderr
    check_plan_output(stdout, 2)
    modes = [re.search(PLAN_ROW.format(index=i), stdout, re.M).group(1) for i in range(2)]
    assert modes != ["off", "off"]  # 70% of off needs some recompute
    assert table_total(stdout, "full") < table_total(stdout, "off")


# ---------------------------------------------------------------------------------------------
# error paths


def test_error_paths_as_processes(runs):
    code, _, stderr = runs["unknown_preset"]  # through the installed `hyperac` script
    assert_one_error_line(code, stderr,
                          r"^hyperac: error: argument --preset: unknown preset 'llama-9'; choose one of .*llama-3-8b")
    code, stdout, stderr = runs["no_budget"]
    assert stdout == ""
    assert_one_error_line(code, stderr, "^hyperac: error: the following arguments are required: --budget")


@pytest.mark.parametrize(
    "argv, pattern",
    [
        (["--preset", "llama-9", "--budget", "0.5"], r"unknown preset 'llama-9'"),
        (["--config", "{missing}", "--budget", "0.5"], r"cannot read config file .*missing\.json"),
        (["--config", "{no_type}", "--budget", "0.5"], r"has no 'model_type'"),
        (["--config", "{not_json}", "--budget", "0.5"], r"is not JSON"),
        (["--config", "{unknown_type}", "--budget", "0.5"], r"cannot build a config for model_type 'no-such-model'"),
        (["--config", "{config}", "--budget", "lots"], r"Config\.budget must be .*'lots'"),
        (["--config", "{config}", "--budget", "0"], r"Config\.budget must be .*'0'"),
        (["--config", "{config}", "--budget", "2.5"], r"Config\.budget must be .*2\.5"),
        (["--config", "{config}", "--budget", "-1"], r"Config\.budget must be"),
        (["--config", "{config}", "--budget", "nan"], r"Config\.budget must be"),
        (["--config", "{config}", "--budget", "0GiB"], r"Config\.budget must be .*'0GiB'"),
        (["--preset", "llama-3-8b", "--budget", "lots"], r"Config\.budget must be"),  # before the estimate
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) else None,
)
def test_error_paths(files, capsys, argv, pattern):
    paths = {name: str(files / f"{name}.json") for name in ("config", "no_type", "not_json", "unknown_type",
                                                             "missing")}
    code = cli.main(["plan", *(arg.format(**paths) for arg in argv)])
    captured = capsys.readouterr()
    assert captured.out == ""
    assert_one_error_line(code, captured.err, "^hyperac: .*" + pattern)


def test_budget_below_the_floor(files, capsys):
    code = cli.main(["plan", "--config", str(files / "config.json"), "--seq", "64", "--budget", "1KiB"])
    captured = capsys.readouterr()
    assert captured.out == ""
    # The estimate runs first and says so on stderr; the error is the one 'hyperac:' line, last.
    assert_one_error_line(code, captured.err, r"^hyperac: error: budget of 1024 bytes .* below the smallest plan",
                          clean=False)


@pytest.mark.parametrize(
    "argv",
    [[], ["plan", "--preset", "llama-3-8b"], ["plan", "--budget", "0.5"],
     ["plan", "--preset", "llama-3-8b", "--config", "c.json", "--budget", "0.5"],
     ["plan", "--preset", "llama-3-8b", "--budget", "0.5", "--dtype", "int8"], ["demo", "--rounds", "x"],
     ["frobnicate"]],
    ids=" ".join,
)
def test_argparse_misuse_exits_2(capsys, argv):
    assert_one_error_line(cli.main(argv), capsys.readouterr().err, "^hyperac: error: ")


@pytest.fixture(scope="module")
def bad_files(files):
    (files / "five.json").write_text("5")
    (files / "heads.json").write_text(json.dumps({**TINY_LLAMA, "num_attention_heads": 5}))
    (files / "big.json").write_text(json.dumps({**TINY_LLAMA, "hidden_size": "big"}))
    (files / "latin1.json").write_bytes(b'{"model_type": "llama", "name": "caf\xe9"}')
    return files


@pytest.mark.parametrize(
    "argv, pattern",
    [
        (["plan", "--config", "{five}", "--budget", "0.5"], r"--config: .*five\.json' holds a JSON int, not an object"),
        (["plan", "--config", "{heads}", "--budget", "0.5"], r"--config: transformers (rejects|cannot build)"),
        (["plan", "--config", "{big}", "--budget", "0.5"], r"--config: transformers (rejects|cannot build)"),
        (["plan", "--config", "{latin1}", "--budget", "0.5"], r"--config: .*latin1\.json' is not UTF-8"),
        (["plan", "--preset", "llama-3-8b", "--budget", "0.5", "--seq", "0"], r"argument --seq: must be a whole"),
        (["plan", "--preset", "llama-3-8b", "--budget", "0.5", "--seq", "-4"], r"argument --seq: .*'-4'"),
        (["plan", "--preset", "llama-3-8b", "--budget", "0.5", "--batch", "0"], r"argument --batch: must be"),
        (["plan", "--preset", "llama-3-8b", "--budget", "2.0"], r"argument --budget: Config\.budget must be .*'2\.0'"),
        (["plan", "--preset", "llama-3-8b", "--budget", "-1GiB"], r"argument --budget: .*'-1GiB'"),
        (["plan", "--preset", "llama-3-8b", "--budget", "0.5", "--device", "tpu"], r"argument --device: invalid"),
        (["plan", "--preset", "llama-3-8b", "--budget", "0.5", "--host-budget", "lots"],
         r"argument --host-budget: must be a positive byte count or a size like '64GiB' .*got 'lots'"),
        (["plan", "--preset", "llama-3-8b", "--budget", "0.5", "--host-budget", "0.5"],
         r"argument --host-budget: .*'0\.5'"),
        (["plan", "--preset", "llama-3-8b", "--budget", "0.5", "--host-budget", "0"], r"argument --host-budget: .*'0'"),
        (["plan", "--preset", "llama-3-8b", "--budget", "0.5", "--host-budget", "-1GiB"],
         r"argument --host-budget: .*'-1GiB'"),
        (["plan", "--preset", "llama-3-8b", "--budget", "0.5", "--device", "cpu", "--host-budget", "1GiB"],
         r"--host-budget: the plan does not swap \(--device cpu has no host link"),
        (["plan", "--preset", "llama-3-8b", "--budget", "0.5", "--no-swap", "--host-budget", "1GiB"],
         r"--host-budget: the plan does not swap \(--no-swap is given\)"),
        (["plan", "--preset", "llama-3-8b", "--budget", "0.5", "--min-swap-bytes", "-1"],
         r"argument --min-swap-bytes: must be a byte count >= 0 or a size like '256KiB', got '-1'"),
        (["plan", "--preset", "llama-3-8b", "--budget", "0.5", "--no-swap", "--min-swap-bytes", "0"],
         r"--min-swap-bytes: the plan does not swap \(--no-swap is given\)"),
        (["demo", "--rounds", "0"], r"argument --rounds: must be a whole number >= 1, got '0'"),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) else None,
)
def test_bad_inputs_exit_2_with_one_line(bad_files, capsys, argv, pattern):
    paths = {name: str(bad_files / f"{name}.json") for name in ("five", "heads", "big", "latin1")}
    code = cli.main([arg.format(**paths) for arg in argv])
    captured = capsys.readouterr()
    assert captured.out == ""
    assert_one_error_line(code, captured.err, "^hyperac: error: .*" + pattern)


def test_demo_plot_without_matplotlib_fails_before_the_demo(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    monkeypatch.setattr(demo, "run", lambda args: pytest.fail("the demo ran"))
    code = cli.main(["demo", "--plot", "x.png"])
    assert_one_error_line(code, capsys.readouterr().err, r"^hyperac: error: argument --plot: needs matplotlib")


# ---------------------------------------------------------------------------------------------
# answering at once: --help and bad arguments import neither torch nor transformers

QUICK = [["--help"], ["plan", "--help"], ["demo", "--help"], ["plan", "--preset", "llama-3-8b", "--budget", "lots"],
         ["plan", "--preset", "llama-9", "--budget", "0.5"], ["plan", "--budget", "0.5"], ["frobnicate"]]


def test_help_and_bad_arguments_answer_at_once():
    """Each runs as a process: its CPU time (user + system, of this child alone) stays under 0.5 s,
    about ten times what it takes (0.04-0.05 s measured on the 2-core CI machine; importing torch and
    transformers took 3.5 s). CPU time, not wall time, so a busy machine does not fail it."""
    import resource

    for argv in QUICK:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        process = subprocess.run([*MODULE, *argv], capture_output=True, text=True, check=False)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        assert process.returncode == (0 if "--help" in argv else 2), process.stderr
        assert cpu < 0.5, f"hyperac {' '.join(argv)} took {cpu:.2f} s of CPU"


def test_parsing_imports_no_torch():
    """The reason the above holds: the package and the CLI import torch only once a command runs."""
    code = ("import sys, contextlib, io\n"
            "from hyperac import cli\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
            "    codes = [cli.main(['plan', '--help']), cli.main(['plan', '--preset', 'x', '--budget', 'lots'])]\n"
            "print(codes, sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    process = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert process.stdout.strip() == "[0, 2] []", process.stdout + process.stderr


def test_device_profiles_match_the_planner():
    from hyperac.planner import DEVICES

    assert cli.DEVICE_PROFILES == tuple(DEVICES)


def test_help_shows_defaults_and_explains_every_option(capsys):
    assert cli.main(["plan", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for default in ("(default: 4096)", "(default: 1)", "(default: bfloat16)", "(default: h100)"):
        assert default in text, text
    assert "(default: None)" not in text and "(default: False)" not in text
    assert cli.main(["demo", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for option in ("--layers LAYERS decoder layers", "--seq SEQ sequence length", "--batch BATCH sequences per"):
        assert option in text, text


# ---------------------------------------------------------------------------------------------
# hyperac plan --output, any architecture, entry points


def run_plan(argv, capsys):
    code = cli.main(["plan", *argv])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


def test_plan_output_is_what_apply_reads(files, capsys, tmp_path):
    """A plan made on the meta device for a profile is applied with apply(plan=json.load(...)): the same
    per-layer modes, on a real model of that config."""
    from transformers import AutoConfig, LlamaForCausalLM

    import hyperac

    path = tmp_path / "plan.json"
    stdout = run_plan(["--config", str(files / "config.json"), "--seq", "64", "--budget", "0.7", "--device", "cpu",
                       "--output", str(path)], capsys)
    printed = [re.search(PLAN_ROW.format(index=i), stdout, re.M).group(1) for i in range(2)]
    written = json.loads(path.read_text())
    assert [layer["mode"] for layer in written["layers"]] == printed
    settings = dict(TINY_LLAMA)
    model = LlamaForCausalLM(AutoConfig.for_model(settings.pop("model_type"), **settings))
    applied = hyperac.apply(model, plan=written)
    try:
        assert [layer.mode for layer in applied.layers] == printed
        assert [layer.fqn for layer in applied.layers] == ["model.layers.0", "model.layers.1"]
    finally:
        hyperac.remove(model)


def estimate_rows(stdout, layers):
    """Per layer, the estimate table's row of MiB kept per mode (the ms are left out)."""
    return [re.findall(r"([\d.]+)/[\d.]+", re.search(rf"^\s*{i}\s+model\.layers\.{i}\s+(.*)$", stdout, re.M).group(1))
            for i in range(layers)]


def test_plan_max_seq_len_plans_for_that_length(files, capsys, tmp_path):
    """``--max-seq-len 128`` at ``--seq 32``: the costs fitted from lengths 16 and 32 to 128, as
    apply(mode="auto", max_seq_len=) plans; on Llama they are the bytes estimated at 128 directly,
    the plan says the length it is for, and so does the plan file."""
    path = tmp_path / "plan.json"
    common = ["--config", str(files / "config.json"), "--budget", "0.6", "--device", "cpu"]
    fitted = run_plan([*common, "--seq", "32", "--max-seq-len", "128", "--output", str(path)], capsys)
    direct = run_plan([*common, "--seq", "128"], capsys)
    short = run_plan([*common, "--seq", "32"], capsys)
    assert estimate_rows(fitted, 2) == estimate_rows(direct, 2) != estimate_rows(short, 2)
    assert re.search(r"^plan for a budget of [\d.]+ GiB, for batches up to sequence length 128 \(costs fitted from "
                     r"lengths 16 and 32\):$", fitted, re.M), fitted
    assert "bytes fitted from lengths 16 and 32 to 128" in fitted
    assert json.loads(path.read_text())["max_seq_len"] == 128


@pytest.mark.parametrize("head, written", [("chunked", "chunked"), ("auto", "off")])
def test_plan_max_seq_len_writes_the_head_it_planned(files, capsys, tmp_path, head, written):
    """``--max-seq-len`` plans per length bucket, which do not weigh the head: ``--head chunked`` plans
    with the head chunked and writes it so; ``--head auto`` keeps it and says why, printed and in the file."""
    path = tmp_path / "plan.json"
    out = run_plan(["--config", str(files / "config.json"), "--budget", "1.0", "--device", "cpu", "--seq", "32",
                    "--max-seq-len", "64", "--head", head, "--output", str(path)], capsys)
    plan = json.loads(path.read_text())
    assert plan["head"] == written
    note = "Config.head='auto' kept the head and the loss as the model computes them: mode='auto' with max_seq_len="
    assert (note in out and note in plan["notes"][-1]) == (head == "auto"), out
    assert ("head: chunked, as --head says" in out) == (head == "chunked"), out


def test_plan_builds_the_architecture_a_config_names(files, capsys):
    bert = dict(model_type="bert", architectures=["BertForMaskedLM"], hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, vocab_size=128)
    (files / "bert.json").write_text(json.dumps(bert))
    stdout = run_plan(["--config", str(files / "bert.json"), "--seq", "32", "--budget", "0.7", "--device", "cpu"],
                      capsys)
    assert re.search(r"^\s*1\s+bert\.encoder\.layer\.1\s", stdout, re.M), stdout


def test_plan_from_an_entry_point(capsys):
    """``--model module:factory``: a plain PyTorch model (tests/hyperac_testing.py's blocks model)."""
    stdout = run_plan(["--model", "hyperac_testing:tiny_blocks_model", "--seq", "32", "--budget", "0.6",
                       "--device", "cpu"], capsys)
    assert re.search(r"^\s*0\s+blocks\.0\s+(off|pointwise|selective|selective-even|full)\s", stdout, re.M), stdout


@pytest.mark.parametrize(("model", "pattern"), [
    ("no_such_module_here:build", r"--model: cannot import 'no_such_module_here'"),
    ("hyperac_testing:no_such_factory", r"--model: module 'hyperac_testing' has no 'no_such_factory'"),
    ("hyperac_testing:lm_loss", r"--model: hyperac_testing:lm_loss\(\) returned a function, not a torch\.nn\.Module"),
    ("hyperac_testing", r"argument --model: must be module:factory"),
])
def test_plan_entry_point_errors(capsys, model, pattern):
    code = cli.main(["plan", "--model", model, "--budget", "0.5", "--device", "cpu"])
    assert_one_error_line(code, capsys.readouterr().err, "^hyperac: error: " + pattern)


def test_plan_output_into_a_missing_folder_fails_before_the_estimate(files, capsys, tmp_path):
    code = cli.main(["plan", "--config", str(files / "config.json"), "--seq", "32", "--budget", "0.7", "--device",
                     "cpu", "--output", str(tmp_path / "no" / "such" / "dir" / "plan.json")])
    assert_one_error_line(code, capsys.readouterr().err,
                          r"^hyperac: error: argument --output: folder '.*dir' does not exist, got '.*plan\.json'")
