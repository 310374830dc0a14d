"""Random models written the way users write them, for tests/test_fuzz.py (issue 26).

Where program_fuzzer.py draws op programs over registers, this generator draws the Python around the
ops: per layer a set of features, each a habit of users' models that a replay may not reproduce by
itself. :class:`FeatureBlock` runs a fixed small computation (two Linears, a nonlinearity) and adds
each drawn feature:

* ``autocast``: part of the layer under ``torch.autocast("cpu", bfloat16)`` (the weight-cast cache);
* ``hook_record`` / ``hook_scale``: a forward hook on a sub-module that records activations into a
  list the model holds, or returns a changed output;
* ``hook_object``: a forward hook that is an object counting its calls and scaling by the count;
* ``slots_state``: a ``@dataclass(slots=True)`` temperature the forward lowers and scales by;
* ``python_random``: a scale drawn from Python's global ``random`` (seeded by the loss);
* ``lazy_hook``: a hook the forward registers on its first call, behind a flag;
* ``one_shot_hook``: a calibration hook that records a scale, removed by the forward once it ran;
* ``counter_value`` / ``counter_branch``: a Python attribute counting calls, used as a value or
  branched on;
* ``aux_list``: an MoE-style auxiliary loss appended to a list the parent owns and adds to the loss;
* ``tensor_attribute``: a plain tensor attribute rebound in forward and read by the next call;
* ``borrowed_norm``: a BatchNorm the parent owns, passed as a keyword argument;
* ``held_linear``: a Linear the parent owns, held in a plain list attribute (not registered);
* ``parametrized``: the first Linear's weight under ``orthogonal``, ``weight_norm`` or ``spectral_norm``,
  read three times;
* ``nested_checkpoint``: the user's own ``torch.utils.checkpoint`` around part of the layer;
* ``data_branch``: a branch on the values of the input;
* ``float64``: part of the layer in float64, cast back;
* ``view_write``: an in-place op that saves its output (``sigmoid_``) on a transposed view of an
  intermediate (with the ``create_graph`` backward, a gradient penalty through it, whose second backward
  reads that saved output twice);

and returns a tensor, a tuple, a dict or a ``transformers`` ``ModelOutput``. The model may call a layer
more than once per forward (ALBERT), runs under ``parametrize.cached()`` or not, and may accumulate its
loss over two sequence lengths. :func:`outcome` (program_fuzzer.py's oracle) compares two SGD steps
applied and un-applied bit for bit.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st
from program_fuzzer import B, D, T
from torch import nn
from torch.nn.utils import parametrizations, parametrize
from transformers.utils import ModelOutput

FEATURES = (
    "autocast", "hook_record", "hook_scale", "counter_value", "counter_branch", "aux_list", "tensor_attribute",
    "borrowed_norm", "held_linear", "parametrized", "nested_checkpoint", "data_branch", "float64", "view_write",
    "hook_object", "slots_state", "python_random", "lazy_hook", "one_shot_hook",
)
PARAMETRIZATIONS = ("orthogonal", "weight_norm", "spectral_norm")
OUTPUTS = ("tensor", "tuple", "dict", "model_output")


@dataclass
class BlockOutput(ModelOutput):
    hidden: torch.Tensor | None = None
    extra: torch.Tensor | None = None


class CountingHook:
    """A forward hook object: scales the output by how often it ran."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return out * (1 + self.calls / 8)


@dataclass(slots=True)
class Temperature:
    value: float = 1.0


class FeatureBlock(nn.Module):
    """One layer: ``tanh(second(act(first(x))))`` plus ``features``."""

    def __init__(self, features: frozenset, parametrization: str, output: str, model: FeatureModel) -> None:
        super().__init__()
        self.features, self.output = features, output
        self.first, self.second = nn.Linear(D, D), nn.Linear(D, D)
        self.calls = 0
        self.last = torch.zeros(D)
        self.aux = model.aux
        self.held = [model.shared_linear] if "held_linear" in features else []
        if "parametrized" in features:
            getattr(parametrizations, parametrization)(self.first)
        if "hook_record" in features:
            self.second.register_forward_hook(lambda module, args, out: model.seen.append(out.detach().sum()))
        if "hook_scale" in features:
            self.first.register_forward_hook(lambda module, args, out: out * 1.5)
        if "hook_object" in features:
            self.first.register_forward_hook(CountingHook())
        self.temperature = Temperature()
        self.hooked = False
        self.amax: float | None = None
        self.calibration = self.second.register_forward_hook(self._calibrate) if "one_shot_hook" in features else None

    def _calibrate(self, module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        self.amax = out.detach().abs().amax().item() + 1

    def _inner(self, x: torch.Tensor) -> torch.Tensor:
        if "parametrized" in self.features:
            h = self.first(x) + x @ self.first.weight.t() * 0.5 + self.first.weight.sum() * 0.01
        else:
            h = self.first(x)
        if "float64" in self.features:
            h = (h.double().sin() * 2).float()
        return torch.relu(h) if "data_branch" not in self.features or x.sum() > 0 else torch.sigmoid(h)

    def forward(self, x: torch.Tensor, norm: nn.Module | None = None) -> Any:
        self.calls += 1
        if "lazy_hook" in self.features and not self.hooked:
            self.first.register_forward_hook(lambda module, args, out: out * 0.5)
            self.hooked = True
        if "nested_checkpoint" in self.features:
            h = torch.utils.checkpoint.checkpoint(self._inner, x, use_reentrant=False)
        else:
            h = self._inner(x)
        if "counter_value" in self.features:
            h = h * (1 + self.calls / 8)
        if "slots_state" in self.features:
            self.temperature.value *= 0.9
            h = h * self.temperature.value
        if "python_random" in self.features:
            h = h * (0.5 + random.random())
        if "counter_branch" in self.features:
            h = h.tanh() if self.calls % 2 else h.exp().clamp(max=4)
        if "autocast" in self.features:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h = self.second(h).float() + self.second(x).float() * 0.5
        else:
            h = self.second(h)
        if self.calibration is not None:
            self.calibration.remove()
            self.calibration = None
        if self.amax is not None:
            h = h / self.amax
        if "view_write" in self.features:
            h = h * 2
            h.transpose(1, 2)[:, 0].sigmoid_()
        if "borrowed_norm" in self.features and norm is not None:
            h = norm(h.reshape(-1, D)).view(h.shape)
        if self.held:
            h = h + self.held[0](x) * 0.5
        if "tensor_attribute" in self.features:
            h = h + self.last
            self.last = h.detach().mean((0, 1))
        if "aux_list" in self.features:
            self.aux.append(h.softmax(-1).square().mean())
        out = torch.tanh(h)
        if self.output == "tuple":
            return out, h
        if self.output == "dict":
            return {"hidden": out, "extra": h}
        if self.output == "model_output":
            return BlockOutput(hidden=out, extra=h)
        return out


class FeatureModel(nn.Module):
    """The layers of a program in ``layers``, called in ``program["schedule"]`` order (a layer may run
    twice), between an input projection and a loss that adds the auxiliary losses."""

    def __init__(self, program: dict) -> None:
        super().__init__()
        self.aux: list = []
        self.seen: list = []
        self.embed = nn.Linear(D, D)
        self.norm = nn.BatchNorm1d(D)
        self.shared_linear = nn.Linear(D, D)
        self.layers = nn.ModuleList(
            FeatureBlock(frozenset(features), parametrization, output, self)
            for features, parametrization, output in program["layers"]
        )
        self.schedule = program["schedule"]

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        self.aux.clear()
        x = self.embed(inputs)
        extra = x.new_zeros(())
        for index in self.schedule:
            layer = self.layers[index]
            out = layer(x, norm=self.norm) if "borrowed_norm" in layer.features else layer(x)
            if isinstance(out, torch.Tensor):
                x = out
            elif isinstance(out, tuple):
                x, e = out
                extra = extra + e.mean()
            else:
                x, e = out["hidden"], out["extra"]
                extra = extra + e.mean()
        return x.square().mean() + 0.1 * extra + 0.1 * sum(self.aux, x.new_zeros(()))


@st.composite
def feature_programs(draw: Callable) -> dict:
    """A model: 2 or 3 layers of drawn features, a schedule (each layer once, or one twice), whether the
    loss runs under ``parametrize.cached()``, and whether it accumulates over two lengths."""
    count = draw(st.integers(2, 3))
    layers = tuple(
        (tuple(draw(st.sets(st.sampled_from(FEATURES), max_size=4))), draw(st.sampled_from(PARAMETRIZATIONS)),
         draw(st.sampled_from(OUTPUTS)))
        for _ in range(count)
    )
    schedule = tuple(range(count))
    if draw(st.booleans()):
        schedule = (*schedule, draw(st.integers(0, count - 1)))
    return {"layers": layers, "schedule": schedule, "cached": draw(st.booleans()), "lengths": draw(st.booleans()),
            "seed": draw(st.integers(0, 2**16))}


def build(program: dict) -> FeatureModel:
    torch.manual_seed(program["seed"])
    return FeatureModel(program)


def loss_fn(program: dict) -> Callable[[nn.Module], torch.Tensor]:
    """The program's loss: one batch of length ``T``, or the sum over lengths ``T`` and ``T + 2``; under
    ``parametrize.cached()`` where the program says so; Python's ``random`` seeded first."""
    def loss(model: nn.Module) -> torch.Tensor:
        random.seed(program["seed"])
        with parametrize.cached() if program["cached"] else contextlib.nullcontext():
            total = model(torch.randn(B, T, D))
            if program["lengths"]:
                total = total + model(torch.randn(B, T + 2, D))
        return total
    return loss
