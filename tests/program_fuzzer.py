"""Random layer programs for tests/test_fuzz.py, and the oracle that runs them applied and un-applied.

A program is data: per layer a tuple of ops over a register file of ``[2, 3, 8]`` tensors (register 0
is the layer's input), what the layer returns, and what the caller writes into the returned tensors.
:class:`ProgramStack` interprets it; hypothesis draws and shrinks it (``programs()``). The ops cover
what went wrong before (issue 16): 2-d and 3-d matmuls (``mm`` then ``_unsafe_view``), attention (by
hand with ``bmm`` and ``F.scaled_dot_product_attention``, with dropout), in-place writes through
views (some saving their output, which a ``create_graph`` backward reads twice), an autograd Function
reading its saved tensors twice, buffers read, updated in place, rebound and shared between layers,
BatchNorm statistics, dropout, ``no_grad`` islands, tuple and dict returns, and writes by the caller
after a layer returned.

:func:`outcome` trains a copy of the program un-applied and one applied in a mode for two SGD steps
(with a plain, a ``retain_graph`` or a ``create_graph`` backward) and compares losses, gradients,
parameters and buffers bit for bit: ``parity``, ``error`` (a documented hyperac error), ``wrong`` or
``crash`` (anything else raised); ``invalid`` when the un-applied program itself fails (a write into
a tensor autograd saved).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

import hyperac

B, T, D = 2, 3, 8
MODES = ("full", "selective", "selective-even", "pointwise", "auto")
BACKWARDS = ("plain", "retain_graph", "create_graph")
DOCUMENTED_ERRORS = (hyperac.InputWrittenError, hyperac.RecomputeMismatchError)
"""What a program may raise applied where it runs un-applied (README, "Buffers and in-place writes")."""

UNARY = ("tanh", "sigmoid", "exp_tanh", "relu", "square", "reread_square")
BINARY = ("add", "mul", "sub")
VIEW_WRITES = ("slice_mul", "unsqueeze_squeeze_sub", "strided_add", "transpose_zero", "slice_relu", "transpose_sigmoid")
BUFFER_UPDATES = ("in_place", "rebind", "counter")
CALLER_WRITES = ("none", "mul", "residual", "view_sub", "aux_mul")
RETURNS = ("tensor", "tuple", "dict")


class ReadsTwice(torch.autograd.Function):
    """``x * w`` (of one shape) whose backward reads ``ctx.saved_tensors`` ``reads`` times (autograd allows
    more than one read; checkpoint alone does not)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, reads: int) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.reads = reads
        return x * w

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        for _ in range(ctx.reads):
            x, w = ctx.saved_tensors
        return grad * w, grad * x, None


def _unary(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "reread_square":
        return ReadsTwice.apply(x, x, 2) * 0.1
    if name == "exp_tanh":
        return x.tanh().exp()
    if name == "square":
        return x.square() * 0.1
    return getattr(torch, name)(x)


def _binary(name: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return {"add": torch.add, "mul": torch.mul, "sub": torch.sub}[name](a, b)


def _write_through_view(kind: str, target: torch.Tensor, value: torch.Tensor) -> None:
    if kind == "slice_mul":
        target[..., :4].mul_(0.5)
    elif kind == "unsqueeze_squeeze_sub":
        target.unsqueeze(0).squeeze(0).sub_(0.1)
    elif kind == "strided_add":
        target.view(-1)[::2].add_(value.reshape(-1)[::2])
    elif kind == "slice_relu":  # in-place ops that save their output: a second backward reads it twice
        torch.relu_(target[..., :4])
    elif kind == "transpose_sigmoid":
        target.transpose(1, 2)[:, 0].sigmoid_()
    else:
        target.transpose(1, 2)[:, 0].zero_()


def _heads(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(B, T, 2, D // 2).transpose(1, 2)


class Stats(nn.Module):
    """Buffers one module of which every layer of a program holds (a shared normalizer, a scale)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, D))


class ProgramBlock(nn.Module):
    """One layer, running ``ops`` (a tuple of tuples, see :func:`programs`) over its registers."""

    def __init__(self, ops: tuple, returns: tuple, shared: Stats) -> None:
        super().__init__()
        self.ops, self.returns = ops, returns
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(D, D) / D**0.5) for _ in range(3))
        self.bias = nn.Parameter(torch.randn(D) / 10)
        self.register_buffer("offset", torch.randn(D) / 10)
        self.register_buffer("count", torch.zeros(()))
        self.register_buffer("running_mean", torch.zeros(D))
        self.register_buffer("running_var", torch.ones(D))
        self.shared = shared

    def _buffer(self, which: int) -> tuple[nn.Module, str]:
        return (self, "offset") if which == 0 else (self.shared, "scale")

    def _run(self, op: tuple, regs: list[torch.Tensor]) -> None:  # noqa: C901 (one branch per op kind)
        kind, *a = op
        r = regs[a[0] % len(regs)]
        if kind == "matmul3d":
            regs.append(r @ self.weights[a[1]])
        elif kind == "matmul2d":
            regs.append((r.reshape(-1, D) @ self.weights[a[1]]).view(B, T, D))
        elif kind == "linear":
            regs.append(F.linear(r, self.weights[a[1]], self.bias))
        elif kind == "attention":
            k, v = regs[a[1] % len(regs)], regs[a[2] % len(regs)]
            scores = ((r @ k.transpose(-1, -2)) * D**-0.5).softmax(-1)
            regs.append(F.dropout(scores, 0.2, self.training) @ v if a[3] else scores @ v)
        elif kind == "sdpa":
            k, v = regs[a[1] % len(regs)], regs[a[2] % len(regs)]
            out = F.scaled_dot_product_attention(_heads(r), _heads(k), _heads(v), is_causal=a[3],
                                                 dropout_p=0.2 if a[4] and self.training else 0.0)
            regs.append(out.transpose(1, 2).reshape(B, T, D))
        elif kind == "unary":
            regs.append(_unary(a[1], r))
        elif kind == "binary":
            regs.append(_binary(a[2], r, regs[a[1] % len(regs)]))
        elif kind == "write":
            _write_through_view(a[1], r, regs[a[2] % len(regs)])
        elif kind == "dropout":
            regs.append(F.dropout(r, 0.3, self.training))
        elif kind == "no_grad":
            with torch.no_grad():
                regs.append(_unary(a[1], r))
        elif kind == "read":
            owner, name = self._buffer(a[1])
            regs.append(r * getattr(owner, name))
        elif kind == "update":
            owner, name = self._buffer(a[1])
            self._update(owner, name, a[2], r)
        elif kind == "batch_norm":
            regs.append(F.batch_norm(r.reshape(-1, D), self.running_mean, self.running_var,
                                     training=self.training, momentum=0.1).view(B, T, D))

    def _update(self, owner: nn.Module, name: str, how: str, r: torch.Tensor) -> None:
        if how == "counter":
            self.count = self.count + 1
            return
        new = r.detach().mean((0, 1)) * 0.1
        if how == "in_place":
            with torch.no_grad():
                getattr(owner, name).mul_(0.9).add_(new)
        else:
            setattr(owner, name, getattr(owner, name) * 0.9 + new)

    def forward(self, x: torch.Tensor) -> Any:
        regs = [x]
        for op in self.ops:
            self._run(op, regs)
        main = regs[-1] * (1 + self.count / 8)
        aux = regs[self.returns[1] % len(regs)]
        if self.returns[0] == "tuple":
            return main, aux
        if self.returns[0] == "dict":
            return {"main": main, "aux": aux}
        return main


class ProgramStack(nn.Module):
    """The layers of a program in a ``layers`` list, between an input projection and a loss."""

    def __init__(self, program: dict) -> None:
        super().__init__()
        self.embed = nn.Parameter(torch.randn(D, D) / D**0.5)
        shared = Stats()
        self.layers = nn.ModuleList(ProgramBlock(ops, returns, shared) for ops, returns in program["layers"])
        self.caller_writes = program["caller_writes"]

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x = inputs @ self.embed
        total = x.new_zeros(())
        for layer, write in zip(self.layers, self.caller_writes):
            out = layer(x)
            main, aux = (out, out) if isinstance(out, torch.Tensor) else (
                (out["main"], out["aux"]) if isinstance(out, dict) else out)
            if write == "mul":
                main.mul_(0.5)
            elif write == "residual":
                main += x
            elif write == "view_sub":
                main.unsqueeze(0).squeeze(0).sub_(0.1)
            elif write == "aux_mul":
                aux.mul_(0.5)
            total = total + aux.mean()
            x = main
        return x.square().mean() + total


@st.composite
def _op(draw: Callable) -> tuple:
    r = st.integers(0, 15)
    kind = draw(st.sampled_from((
        "matmul3d", "matmul2d", "linear", "attention", "sdpa", "unary", "unary", "binary", "write", "dropout",
        "no_grad", "read", "update", "batch_norm")))
    w = st.integers(0, 2)
    args = {
        "matmul3d": (r, w), "matmul2d": (r, w), "linear": (r, w),
        "attention": (r, r, r, st.booleans()), "sdpa": (r, r, r, st.booleans(), st.booleans()),
        "unary": (r, st.sampled_from(UNARY)), "binary": (r, r, st.sampled_from(BINARY)),
        "write": (r, st.sampled_from(VIEW_WRITES), r), "dropout": (r,), "no_grad": (r, st.sampled_from(UNARY)),
        "read": (r, st.integers(0, 1)), "update": (r, st.integers(0, 1), st.sampled_from(BUFFER_UPDATES)),
        "batch_norm": (r,),
    }[kind]
    return (kind, *(draw(arg) for arg in args))


@st.composite
def programs(draw: Callable, max_ops: int = 12) -> dict:
    """A program: 2 or 3 layers of 1 to ``max_ops`` ops, a return and a caller write per layer."""
    count = draw(st.integers(2, 3))
    layers = tuple(
        (tuple(draw(st.lists(_op(), min_size=1, max_size=max_ops))),
         (draw(st.sampled_from(RETURNS)), draw(st.integers(0, 15))))
        for _ in range(count)
    )
    return {"layers": layers, "caller_writes": tuple(draw(st.sampled_from(CALLER_WRITES)) for _ in range(count)),
            "seed": draw(st.integers(0, 2**16))}


def build(program: dict) -> ProgramStack:
    torch.manual_seed(program["seed"])
    return ProgramStack(program)


def _loss(model: nn.Module) -> torch.Tensor:
    return model(torch.randn(B, T, D))


def _backward(loss: torch.Tensor, parameters: list[nn.Parameter], kind: str) -> None:
    if kind == "retain_graph":
        loss.backward(retain_graph=True)
        loss.backward()
    elif kind == "create_graph":
        grads = torch.autograd.grad(loss, parameters, create_graph=True, allow_unused=True)
        penalty = sum((g * g).sum() for g in grads if g is not None)
        (loss + 0.1 * penalty).backward()
    else:
        loss.backward()


def train(model: nn.Module, backward: str = "plain", loss_fn: Callable[[nn.Module], torch.Tensor] = _loss,
          steps: int = 2) -> list[tuple[str, torch.Tensor]]:
    """Everything ``steps`` SGD steps produce (the RNG seeded with the step's number before each
    ``loss_fn``): losses, the last gradients, parameters and buffers."""
    model.train()
    parameters = list(model.parameters())
    optimizer = torch.optim.SGD(parameters, lr=0.1)
    record = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        torch.manual_seed(step)
        loss = loss_fn(model)
        _backward(loss, parameters, backward)
        record.append((f"loss {step}", loss.detach().clone()))
        optimizer.step()
    record += [(f"grad {n}", p.grad.clone()) for n, p in model.named_parameters() if p.grad is not None]
    return record + [(f"state {n}", v.clone()) for n, v in model.state_dict().items()]


_SAME_SIZE_INTEGERS = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16,
                       torch.float16: torch.int16}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_SAME_SIZE_INTEGERS[t.dtype]) if t.dtype in _SAME_SIZE_INTEGERS else t


def differences(expected: list[tuple[str, torch.Tensor]], actual: list[tuple[str, torch.Tensor]]) -> list[str]:
    """Names whose tensors differ bit for bit (NaNs included), or that only one side has."""
    if [name for name, _ in expected] != [name for name, _ in actual]:
        return ["the set of recorded tensors"]
    return [name for (name, e), (_, a) in zip(expected, actual)
            if e.shape != a.shape or e.dtype != a.dtype or not torch.equal(_bits(e), _bits(a))]


def apply_mode(model: nn.Module, mode: str, sample: Callable[[nn.Module], torch.Tensor] = _loss) -> None:
    """Apply ``mode``; ``auto`` gets a sample step and a budget halfway between its smallest plan
    (every layer in full recompute, which a first apply with a 1 KiB budget reports) and twice that."""
    if mode != "auto":
        hyperac.apply(model, mode=mode, backend="cpu", layers="layers")
        return
    try:
        hyperac.apply(model, mode="auto", backend="cpu", layers="layers", budget="1KiB", sample=sample)
    except hyperac.ConfigError as error:
        smallest = re.search(r"smallest plan: (\d+) bytes", str(error))
        if smallest is None:
            raise
        budget = int(smallest.group(1)) * 3 // 2
        hyperac.apply(model, mode="auto", backend="cpu", layers="layers", budget=budget, sample=sample)


def reference(program: dict, backward: str, make: Callable[[dict], nn.Module] | None = None,
              loss_fn: Callable[[nn.Module], torch.Tensor] = _loss) -> list[tuple[str, torch.Tensor]] | str:
    """What the un-applied program records in :func:`train`, or why it fails (an ``invalid`` program);
    ``make`` builds the model from the program (:func:`build` by default), ``loss_fn`` is its loss."""
    try:
        return train((make or build)(program), backward, loss_fn)
    except RuntimeError as error:
        return f"{type(error).__name__}: {str(error)[:200]}"


def outcome(program: dict, mode: str, backward: str, expected: list[tuple[str, torch.Tensor]],
            make: Callable[[dict], nn.Module] | None = None,
            loss_fn: Callable[[nn.Module], torch.Tensor] = _loss) -> tuple[str, str]:
    """(``parity`` | ``error`` | ``wrong`` | ``crash``, detail) of ``program`` applied in ``mode``,
    against ``expected``, the un-applied :func:`reference` (``make`` and ``loss_fn`` as there)."""
    model = (make or build)(program)
    before = copy.deepcopy(model.state_dict())
    try:
        apply_mode(model, mode, loss_fn)
        changed = differences(list(before.items()), list(model.state_dict().items()))
        if changed:
            return "wrong", f"apply changed {changed[:3]}"
        actual = train(model, backward, loss_fn)
    except DOCUMENTED_ERRORS as error:
        return "error", f"{type(error).__name__}: {str(error)[:200]}"
    except Exception as error:  # noqa: BLE001 (anything else is a finding)
        return "crash", f"{type(error).__name__}: {str(error)[:300]}"
    different = differences(expected, actual)
    return ("wrong", f"differs: {different[:5]}") if different else ("parity", "")
