"""Every op of torch's own autocast lists has a class in the default policy and runs as autocast runs it.

The lists are read from the installed torch (``torch/testing/_internal/autocast_test_lists.py``: CUDA's
``AutocastTestLists`` and the CPU's ``AutocastCPUTestLists``), so the ops a new torch adds show up here. Each entry
becomes a one-op module on the list's own arguments, converted in both low dtypes; the dtypes every aten op saw
are recorded and compared with the same module run under ``torch.autocast("cpu")``. Where the two differ, the op is
in one of the tables below with the reason, and docs/policy.md says the same.
"""
import ast
import collections
import dataclasses
import functools
import importlib.util
import pathlib
from typing import Callable

import pytest
import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

import autocastfx
from autocastfx.core.policy import OpClass
from helpers import AtenRecorder

pytestmark = [  # torch's own warnings about the lists' calls
    pytest.mark.filterwarnings("ignore:torch.chain_matmul is deprecated"),
    pytest.mark.filterwarnings("ignore:Using torch.cross without specifying the dim"),
    pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight"),  # rms_norm: kernels.py
]


def load_autocast_lists():
    """(CUDA lists, CPU lists), built on the CPU from the installed torch's own file.

    Both classes take the device as their one argument. Importing the file itself pulls in torch's test harness
    (``common_utils`` needs ``expecttest``), so only the two list classes are compiled from its source, with
    ``TEST_WITH_ROCM`` false: every entry is kept, the cuDNN convolutions included."""
    spec = importlib.util.find_spec("torch.testing._internal.autocast_test_lists")
    tree = ast.parse(pathlib.Path(spec.origin).read_text())
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef)
               and n.name in ("AutocastTestLists", "AutocastCPUTestLists")]
    ns = {"torch": torch, "collections": collections, "TEST_WITH_ROCM": False}
    exec(compile(ast.Module(classes, type_ignores=[]), spec.origin, "exec"), ns)
    return ns["AutocastTestLists"]("cpu"), ns["AutocastCPUTestLists"]("cpu")


# What autocast does with each list (torch's test_cuda.py / test_autocast.py run them so): "low" casts every
# float input to the low dtype, "fp32" to float32, "one" gives every float input one dtype (autocast: the widest;
# builtin: the kernel promotes by itself).
CATEGORY = {
    "torch_fp16": "low", "nn_fp16": "low", "linalg_fp16": "low", "methods_fp16": "low", "torch_16": "low",
    "nn_16": "low", "torch_fp32": "fp32", "nn_fp32": "fp32", "methods_fp32": "fp32", "banned": "fp32",
    "torch_need_autocast_promote": "one", "torch_expect_builtin_promote": "one",
    "methods_expect_builtin_promote": "one",
}
_CLASS = {"low": OpClass.LOW, "fp32": OpClass.FP32, "one": OpClass.PROMOTE}
_MODULE = {"nn_fp16": torch._C._nn, "nn_fp32": torch._C._nn, "nn_16": torch._C._nn, "linalg_fp16": torch._C._linalg}

# CUDA autocast casts these and CPU autocast does not (it has no entry for them, or another one): autocastfx has
# one table for both devices and runs them as CUDA's list says. Each must still differ from CPU autocast here.
CUDA_ONLY = frozenset("""
    _convolution convolution addmv addr mv lstm_cell gru_cell
    acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow __pow__ layer_norm
    group_norm norm cosine_similarity dist renorm logsumexp softplus
""".split())

_FP32_OUT = ("a float32 result from the low input as it is, through the op's own dtype= argument (CUDA autocast "
             "casts the input up first, CPU autocast leaves the op low)")

# op -> (what autocastfx runs it as, why that differs from torch.autocast on the CPU). "input": in its first float
# input's dtype; "fp32_out": every result float32.
DIFFERS = {
    "prelu": ("input", "an elementwise op with a weight: it follows its input (promote), where autocast runs it "
                       "low to make input and weight agree; a float32 input gains nothing from a cast down"),
    "einsum": ("low", "autocastfx casts einsum's operands, torch.autocast the bmm inside it: the copies einsum "
                      "makes of its operands before the bmm are in the other dtype, the bmm is the same"),
    "bilinear": ("low", "a matmul (x1 W x2): low like linear, where autocast gives its inputs the widest dtype"),
    "reflection_pad1d": ("input", "a pad moves values without arithmetic and the CPU has its low kernels: it "
                                  "follows its input (CPU autocast lists it float32)"),
    **{op: ("fp32_out", _FP32_OUT) for op in "softmax log_softmax sum prod cumsum cumprod".split()},
}
# Under Policy(widest=False) these would differ too: a promote op takes one dtype, the one the min-cut finds
# cheapest, which may be the low one (autocast: the widest). The default policy runs them as autocast does.
MIN_CUT_ONLY = frozenset("cat stack addcdiv addcmul grid_sampler".split())

# The list hands these mixed dtypes that the op rejects outside autocast (no builtin promotion), so a module
# handed them would not run to be captured: the module takes every tensor in float32 and makes the list's low
# ones low itself, by a matmul with the identity (a low op), as a converted model hands such an op a low value.
MADE_LOW = frozenset("bilinear dot vdot tensordot index_put scatter_add cross".split())

# CPU autocast leaves these as they come and the kernel rejects what it gets: nothing to compare with, and
# autocastfx is checked against the list's category alone.
NO_REFERENCE = {
    **{op: "CPU autocast has no promote entry for it, and the kernel rejects a low and a float32 input"
       for op in MADE_LOW},
    "pdist": "CPU autocast leaves it low and the CPU has no low pdist kernel (kernels.CPU_GAPS)",
}

# Not converted here; their policy class is checked alone.
CANNOT = {
    "cudnn_convolution": "cuDNN only: the CPU has no kernel",
    "cudnn_convolution_transpose": "cuDNN only: the CPU has no kernel",
}

# Captured by torch.export rather than traced, where torch.fx cannot trace the call.
EXPORTED = {"__div__": "torch.fx maps Tensor.__div__ to operator.div, which Python 3 does not have"}


@dataclasses.dataclass
class Entry:
    id: str
    op: str
    list_name: str
    fn: Callable
    args: dict            # dtype -> the list's arguments for that dtype
    kwargs: dict


def entries() -> list[Entry]:
    out = []
    for device, lists in zip(("cuda", "cpu"), load_autocast_lists()):
        for list_name, items in vars(lists).items():
            for k, e in enumerate(items):
                out.append(_entry(f"{device}.{list_name}.{e[0]}#{k}", list_name, e))
    return out


def _entry(id_, list_name, e) -> Entry:
    op, rest = e[0], list(e[1:])
    module = _MODULE.get(list_name, torch)
    if rest and isinstance(rest[-1], torch.dtype):   # builtin promote lists: the dtype out
        rest.pop()
    if rest and isinstance(rest[-1], bool):          # TEST_WITH_ROCM: skip on ROCm
        rest.pop()
    if list_name == "banned":                        # (op, args, module)
        module = rest.pop()
    kwargs = rest.pop() if len(rest) > 1 and isinstance(rest[-1], dict) else {}
    if op == "einsum":  # (op, equation, operands): 2-d matrices for a 4-d equation, viewed as 2x2x2x8
        eq, operands = rest
        rest = [(eq, *(t.view(2, 2, 2, -1) for t in operands))]
    if len(rest) == 2:  # the CPU lists give a bfloat16 and a float16 set
        args = {torch.bfloat16: rest[0], torch.float16: rest[1]}
    else:
        args = {d: _low_as(rest[0], d) for d in (torch.bfloat16, torch.float16)}
    if list_name.startswith("methods") or not hasattr(module, op):
        fn = functools.partial(_method, op)
    else:
        fn = getattr(module, op)
    return Entry(id_, op, list_name, fn, args, kwargs)


def _method(op, self, *args, **kwargs):
    return getattr(self, op)(*args, **kwargs)


def _low_as(v, dtype):
    """The list's low-precision tensors (float16 in CUDA's lists, bfloat16 in the CPU's) in ``dtype``."""
    if isinstance(v, torch.Tensor):
        return v.to(dtype) if v.dtype in (torch.float16, torch.bfloat16) else v
    if isinstance(v, (tuple, list)):
        return type(v)(_low_as(x, dtype) for x in v)
    return v


class OneOp(nn.Module):
    """Calls one op on an entry's arguments: its tensors are the forward's inputs, everything else constants.
    ``made_low``: every input float32, the list's low ones made low inside by a matmul with the identity."""

    def __init__(self, fn, args, kwargs, made_low=False):
        super().__init__()
        self.fn = fn
        leaves, self.spec = tree_flatten((tuple(args), kwargs))
        self.consts = [None if isinstance(v, torch.Tensor) else v for v in leaves]
        self.slots = [isinstance(v, torch.Tensor) for v in leaves]
        tensors = [v for v in leaves if isinstance(v, torch.Tensor)]
        self.low = [made_low and t.dtype in (torch.float16, torch.bfloat16) for t in tensors]
        for i, (t, low) in enumerate(zip(tensors, self.low)):
            if low:
                self.register_buffer(f"eye{i}", torch.eye(t.shape[-1]))
        self.inputs = tuple(t.float() if low else t for t, low in zip(tensors, self.low))

    def call(self, *tensors):
        it = iter(t @ getattr(self, f"eye{i}") if low else t for i, (t, low) in enumerate(zip(tensors, self.low)))
        args, kwargs = tree_unflatten([next(it) if s else c for s, c in zip(self.slots, self.consts)], self.spec)
        return self.fn(*args, **kwargs)


def one_op(e: Entry, dtype) -> OneOp:
    n = sum(isinstance(v, torch.Tensor) for v in tree_flatten((tuple(e.args[dtype]), e.kwargs))[0])
    names = ", ".join(f"x{i}" for i in range(n))
    ns: dict = {}
    exec(f"def forward(self, {names}):\n    return self.call({names})\n", ns)  # torch.fx traces no *args
    cls = type(f"OneOp_{e.op}", (OneOp,), {"forward": ns["forward"]})
    return cls(e.fn, e.args[dtype], e.kwargs, made_low=e.op in MADE_LOW)


_CASTS = {"_to_copy", "to", "copy_", "_to_dtype"}
Call = collections.namedtuple("Call", "op ins dtype outs")  # float input dtypes, promoted, float output dtypes


class Calls(AtenRecorder):
    """The aten calls that compute: views and dtype copies (the casts, wherever they sit) left out."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if func.is_view or func._opname in _CASTS:
            self.calls.pop()
        return out

    def computed(self) -> list[Call]:
        res = []
        for c in self.calls:
            ins = tuple(d for d in c.in_dtypes if d.is_floating_point)
            outs = tuple(d for d in c.out_dtypes if d.is_floating_point)
            res.append(Call(c.name, ins, functools.reduce(torch.promote_types, ins) if ins else None, outs))
        return res


def same(a: list[Call], b: list[Call]) -> bool:
    """Each op computes in the same dtype and returns the same dtypes (a mixed call promotes as a cast would)."""
    return [(c.op, c.dtype, c.outs) for c in a] == [(c.op, c.dtype, c.outs) for c in b]


def runs_as(calls: list[Call], what: str, dtype, first_input) -> bool:
    """Whether the calls run as ``what`` says (CATEGORY and DIFFERS above)."""
    floats = [c for c in calls if c.ins]
    if not floats:
        return False
    if what == "low":
        return all(c.dtype == dtype for c in floats)
    if what == "fp32":
        return all(c.dtype == torch.float32 for c in floats)
    if what == "fp32_out":
        return all(set(c.outs) <= {torch.float32} for c in floats)
    if what == "input":
        return all(c.dtype == first_input for c in floats)
    if what == "one":
        return all(len(set(c.ins)) == 1 for c in floats)
    raise ValueError(what)


def _runs(m: OneOp) -> bool:
    try:
        m.call(*m.inputs)
        return True
    except RuntimeError:
        return False


def _run(m, inputs, autocast=None):
    rec = Calls()
    with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None), rec:
        m(*inputs)
    return rec.computed()


# float16 kernels on the CPU are slow; the lists' tensors are small (8 x 8), so both dtypes run every entry
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_every_autocast_op_runs_as_autocast_runs_it(dtype):
    problems, differed, no_ref = [], set(), set()
    for e in entries():
        if e.list_name not in CATEGORY:
            problems.append(f"{e.id}: a list this test does not know ({e.list_name}): give it a CATEGORY")
            continue
        if e.op in CANNOT:
            want = _CLASS[CATEGORY[e.list_name]]
            if autocastfx.Policy.default().op_table.get(e.op) is not want:
                problems.append(f"{e.id}: not {want} in the default policy")
            continue
        m = one_op(e, dtype)
        if e.op in MADE_LOW and _runs(OneOp(e.fn, e.args[dtype], e.kwargs)):
            problems.append(f"{e.id}: runs on the list's arguments as they are: drop it from MADE_LOW")
        try:
            ref = _run(m, m.inputs, autocast=dtype)
        except Exception as ex:  # noqa: BLE001 - the lists' mixed arguments, for an op CPU autocast leaves
            ref = ex
        try:
            gm = autocastfx.convert(m, m.inputs, dtype=dtype)
            got = _run(gm, m.inputs)
        except Exception as ex:  # noqa: BLE001 - every failure is reported below, with its entry
            problems.append(f"{e.id}: converted, fails: {type(ex).__name__}: {str(ex).splitlines()[0][:200]}")
            continue
        info = gm.meta["autocastfx"]
        if info.capture != ("torch.export" if e.op in EXPORTED else "symbolic_trace"):
            problems.append(f"{e.id}: captured by {info.capture}")
        unclassified = autocastfx.report(gm).totals["unclassified"]
        if unclassified:
            problems.append(f"{e.id}: on no policy list: {unclassified}")
        what = DIFFERS[e.op][0] if e.op in DIFFERS else CATEGORY[e.list_name]
        first = next(t.dtype for t in m.inputs if t.is_floating_point())
        if not runs_as(got, what, dtype, first):
            problems.append(f"{e.id}: autocastfx should run it as {what!r}, ran {got}")
        if isinstance(ref, Exception):
            no_ref.add(e.op)
            if e.op not in NO_REFERENCE:
                problems.append(f"{e.id}: fails under torch.autocast on the CPU ({str(ref).splitlines()[0][:120]})"
                                f" and is not in NO_REFERENCE")
        elif not same(got, ref):
            differed.add(e.op)
            if e.op not in DIFFERS and e.op not in CUDA_ONLY:
                problems.append(f"{e.id}: differs from torch.autocast on the CPU and is in no table:\n"
                                f"    autocast:   {ref}\n    autocastfx: {got}")
    for op in sorted((set(DIFFERS) | CUDA_ONLY) - differed - set(NO_REFERENCE)):
        problems.append(f"{op}: listed as differing from torch.autocast on the CPU, but runs the same: drop it")
    for op in sorted(set(NO_REFERENCE) - no_ref):
        problems.append(f"{op}: in NO_REFERENCE, but torch.autocast on the CPU runs it now: compare it")
    assert not problems, "\n".join(problems)


def test_every_difference_is_written_in_the_docs():
    text = (pathlib.Path(__file__).parents[1] / "docs" / "policy.md").read_text()
    section = text[text.index("## Against `torch.autocast`"):]
    tables = set(CUDA_ONLY) | set(DIFFERS) | MIN_CUT_ONLY | MADE_LOW | set(NO_REFERENCE) | set(CANNOT) | set(EXPORTED)
    for op in sorted(tables):
        bare = op.strip("_") if op.startswith("__") else op  # Tensor.__eq__ is eq
        assert f"`{op}`" in section or f"`{bare}`" in section, op
