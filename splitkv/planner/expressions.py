"""A tiny expression type, so that each of the cost model's rows is written once
(``features.ROW_EXPRESSIONS``) and computed alike by the host planner (NumPy, a whole row of
candidates per call) and by the planner on the device (C++ for ``device_plan.cuh``).

Why: the two planners must choose the same plan to the bit, so every row must be the same IEEE
float64 operations in the same order on both. An expression is a tree of those operations (a
node may be shared, and is then computed once); both compilers walk it in one order and emit
one operation per node, so neither reassociates, and nothing is contracted into an FMA (the
planning kernel compiles with --fmad=false, the host tests with -ffp-contract=off; NumPy fuses
nothing).

Operations: + - * / of float64; ``minimum`` and ``maximum`` (NumPy's, the header's ``dmin``
and ``dmax``: the same for every value but NaN, which no row meets); ``ceil``, ``floor``,
``fmod``; comparisons ``ge``, ``gt``, ``le``, ``lt``, ``eq`` (1.0 or 0.0); ``select``;
``at_least_one`` (max(x, 1): a divisor that is 0 only for a decomposition of no chunks, so the
planner, whose every candidate has some, skips it). Python numbers are constants.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np


class Expr:
    """One node: ``op`` and its ``args`` (nodes; a float for 'const', a name for 'input').
    Nodes compare by identity, so a shared node is one computation."""

    __slots__ = ("op", "args")

    def __init__(self, op: str, args: tuple):
        self.op, self.args = op, args

    def __add__(self, other):
        return Expr("+", (self, wrap(other)))

    def __radd__(self, other):
        return Expr("+", (wrap(other), self))

    def __sub__(self, other):
        return Expr("-", (self, wrap(other)))

    def __rsub__(self, other):
        return Expr("-", (wrap(other), self))

    def __mul__(self, other):
        return Expr("*", (self, wrap(other)))

    def __rmul__(self, other):
        return Expr("*", (wrap(other), self))

    def __truediv__(self, other):
        return Expr("/", (self, wrap(other)))

    def __rtruediv__(self, other):
        return Expr("/", (wrap(other), self))

    def __bool__(self):
        raise TypeError("an expression has no truth value: compare with ge/gt/le/lt/eq and "
                        "choose with select")

    def __repr__(self):
        if self.op in ("const", "input"):
            return str(self.args[0])
        if self.op in _INFIX:
            return f"({self.args[0]!r} {self.op} {self.args[1]!r})"
        return f"{self.op}({', '.join(map(repr, self.args))})"


def wrap(value) -> Expr:
    """A node, or a Python number as a constant."""
    if isinstance(value, Expr):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ValueError(f"constant {value!r}: expected a finite number")
        return Expr("const", (float(value),))
    raise TypeError(f"expected an expression or a number, got {value!r}")


def inputs(*names: str) -> SimpleNamespace:
    """Named inputs, as attributes: ``S = inputs("num_chunks"); S.num_chunks * 2``."""
    return SimpleNamespace(**{name: Expr("input", (name,)) for name in names})


def minimum(a, b) -> Expr:
    return Expr("minimum", (wrap(a), wrap(b)))


def maximum(a, b) -> Expr:
    return Expr("maximum", (wrap(a), wrap(b)))


def ceil(a) -> Expr:
    return Expr("ceil", (wrap(a),))


def floor(a) -> Expr:
    return Expr("floor", (wrap(a),))


def fmod(a, b) -> Expr:
    return Expr("fmod", (wrap(a), wrap(b)))


def ge(a, b) -> Expr:
    return Expr(">=", (wrap(a), wrap(b)))


def gt(a, b) -> Expr:
    return Expr(">", (wrap(a), wrap(b)))


def le(a, b) -> Expr:
    return Expr("<=", (wrap(a), wrap(b)))


def lt(a, b) -> Expr:
    return Expr("<", (wrap(a), wrap(b)))


def eq(a, b) -> Expr:
    return Expr("==", (wrap(a), wrap(b)))


def select(condition, if_true, if_false) -> Expr:
    """``if_true`` where ``condition`` is not 0, else ``if_false``."""
    return Expr("select", (wrap(condition), wrap(if_true), wrap(if_false)))


def at_least_one(a) -> Expr:
    """max(a, 1), skipped by a caller that says every column is at least 1 (``some_items``)."""
    return Expr("at_least_one", (wrap(a),))


_INFIX = ("+", "-", "*", "/", ">=", ">", "<=", "<", "==")
# op -> (NumPy ufunc, C++ format)
_OPS = {
    "+": (np.add, "{} + {}"), "-": (np.subtract, "{} - {}"), "*": (np.multiply, "{} * {}"),
    "/": (np.divide, "{} / {}"), "minimum": (np.minimum, "dmin({}, {})"),
    "maximum": (np.maximum, "dmax({}, {})"), "fmod": (np.fmod, "fmod({}, {})"),
    "ceil": (np.ceil, "ceil({})"), "floor": (np.floor, "floor({})"),
    ">=": (np.greater_equal, "({} >= {} ? 1.0 : 0.0)"),
    ">": (np.greater, "({} > {} ? 1.0 : 0.0)"),
    "<=": (np.less_equal, "({} <= {} ? 1.0 : 0.0)"),
    "<": (np.less, "({} < {} ? 1.0 : 0.0)"),
    "==": (np.equal, "({} == {} ? 1.0 : 0.0)"),
    "at_least_one": (np.maximum, "dmax({}, 1.0)"),
    "select": (None, "({} != 0.0 ? {} : {})"),
}


def ordered(outputs) -> list[Expr]:
    """Every node the outputs need, each once, operands before their users (depth first, in
    the outputs' order: the order both compilers emit)."""
    seen, order = set(), []
    for root in outputs:
        stack = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if id(node) in seen:
                continue
            if expanded or node.op in ("const", "input"):
                seen.add(id(node))
                order.append(node)
                continue
            stack.append((node, True))
            stack.extend((arg, False) for arg in reversed(node.args))
    return order


def _cpp_constant(value: float) -> str:
    text = repr(value)              # the shortest decimal that reads back as the same double
    return text if any(c in text for c in ".en") else text + ".0"


def cpp_statements(outputs: dict, source: str = "in", target: str = "r") -> list[str]:
    """C++ statements computing ``outputs`` {name: expression or number} into
    ``target.name`` from ``source.input``: one ``const double`` per operation, in
    ``ordered``'s order."""
    outputs = {name: wrap(expr) for name, expr in outputs.items()}
    names, lines = {}, []
    for node in ordered(outputs.values()):
        if node.op == "const":
            names[id(node)] = _cpp_constant(node.args[0])
        elif node.op == "input":
            names[id(node)] = f"{source}.{node.args[0]}"
        else:
            temp = f"t{len(lines)}"
            text = _OPS[node.op][1].format(*(names[id(a)] for a in node.args))
            lines.append(f"const double {temp} = {text};")
            names[id(node)] = temp
    lines += [f"{target}.{name} = {names[id(expr)]};" for name, expr in outputs.items()]
    return lines


def input_names(outputs) -> tuple[str, ...]:
    """The inputs the outputs read, in first-use order."""
    return tuple(node.args[0] for node in ordered(outputs) if node.op == "input")


class RowProgram:
    """Expressions {name: expression or number} compiled for NumPy: ``fill(rows, *scalars,
    some_items=False)`` computes every one of n columns at once into a [size, n] array laid
    out as ``names`` (the row inputs, then the outputs), then ``scratch`` rows of temporaries;
    ``scalars`` are the scalar inputs in order, as 0-d arrays (NumPy converts a Python number
    on every call). One ufunc call per operation, each writing its row in place: the same
    operations in the same order as ``cpp_statements``. ``fill`` is Python written once per
    table (``source``), so a call costs its ufunc calls and little else."""

    def __init__(self, outputs: dict, row_inputs: tuple, scalar_inputs: tuple):
        used = input_names(map(wrap, outputs.values()))
        unknown = set(used) - set(row_inputs) - set(scalar_inputs)
        if unknown:
            raise ValueError(f"expressions read {sorted(unknown)}, which are not inputs")
        clash = set(outputs) & (set(row_inputs) | set(scalar_inputs))
        if clash:
            raise ValueError(f"outputs {sorted(clash)} are also inputs")
        self.outputs = {name: wrap(expr) for name, expr in outputs.items()}
        self.row_inputs, self.scalar_inputs = tuple(row_inputs), tuple(scalar_inputs)
        self.names = self.row_inputs + tuple(outputs)
        self.source, self.scratch, constants = self._python()
        self.size = len(self.names) + self.scratch
        namespace = {name: getattr(np, name) for name in _NUMPY_NAMES}
        namespace.update(constants)
        exec(compile(self.source, f"<rows {', '.join(outputs)}>", "exec"), namespace)
        self.fill = namespace["fill"]

    def _python(self):
        """The source of ``fill``, its scratch rows and its constants (name: 0-d array). A
        node that is an output is computed into its row (into the first, where two outputs
        are one node; the other copies it), any other row-valued node into a scratch row,
        free again after its last use, a node of scalars alone into a local."""
        order = ordered(self.outputs.values())
        out_row = {}
        for name, expr in self.outputs.items():
            out_row.setdefault(id(expr), self.names.index(name))
        last = {}                       # node -> position of its last user
        for i, node in enumerate(order):
            for arg in node.args if node.op not in ("const", "input") else ():
                last[id(arg)] = i
        for node in reversed(order):    # a skipped at_least_one reads its operand's row
            if node.op == "at_least_one" and id(node) in last:
                arg = node.args[0]
                last[id(arg)] = max(last[id(arg)], last[id(node)])
        refs, body, constants, is_row = {}, [], {}, set()
        scratch_of, free, scratch = {}, [], 0
        for i, node in enumerate(order):
            if node.op == "const":
                refs[id(node)] = self._constant(constants, node.args[0])
                continue
            if node.op == "input":
                name = node.args[0]
                if name in self.row_inputs:
                    refs[id(node)] = f"r{self.row_inputs.index(name)}"
                    is_row.add(id(node))
                else:
                    refs[id(node)] = f"s{self.scalar_inputs.index(name)}"
                continue
            args = [refs[id(a)] for a in node.args]
            if not any(id(a) in is_row for a in node.args):
                target = f"v{i}"
                if node.op == "select":
                    body.append(f"{target} = where({args[0]} != 0.0, {args[1]}, {args[2]})")
                elif node.op == "at_least_one":
                    body.append(f"{target} = {args[0]} if some_items else "
                                f"maximum({args[0]}, {self._constant(constants, 1.0)})")
                else:
                    body.append(f"{target} = {_OPS[node.op][0].__name__}({', '.join(args)})")
                refs[id(node)] = target
                continue
            if id(node) in out_row:
                row = out_row[id(node)]
            else:
                if not free:
                    free.append(len(self.names) + scratch)
                    scratch += 1
                row = scratch_of[id(node)] = free.pop()
            target = f"r{row}"
            is_row.add(id(node))
            if node.op == "select":
                body.append(f"copyto({target}, where({args[0]} != 0.0, {args[1]}, {args[2]}))")
            elif node.op == "at_least_one":
                one = self._constant(constants, 1.0)
                if id(node) in out_row:
                    body.append(f"copyto({target}, {args[0]}) if some_items else "
                                f"maximum({args[0]}, {one}, out={target})")
                else:          # skipped: later operations read the operand's row itself
                    target = f"a{i}"
                    body.append(f"{target} = {args[0]} if some_items else "
                                f"maximum({args[0]}, {one}, out=r{row})")
            elif node.op in ("minimum", "maximum"):    # a positional out is slow there
                body.append(f"{node.op}({', '.join(args)}, out={target})")
            else:
                body.append(f"{_OPS[node.op][0].__name__}({', '.join(args)}, {target})")
            refs[id(node)] = target
            for arg in {id(a) for a in node.args}:
                if last[arg] == i and arg in scratch_of:
                    free.append(scratch_of.pop(arg))
        for name, expr in self.outputs.items():
            row = self.names.index(name)
            if refs[id(expr)] != f"r{row}":
                body.append(f"copyto(r{row}, {refs[id(expr)]})")
        size = len(self.names) + scratch
        head = [f"def fill(rows, {''.join(f's{i}, ' for i in range(len(self.scalar_inputs)))}"
                "some_items=False):",
                f"    ({''.join(f'r{i}, ' for i in range(size))}) = rows"]
        return "\n".join(head + ["    " + line for line in body] + ["    return rows", ""]), \
            scratch, constants

    @staticmethod
    def _constant(constants: dict, value: float) -> str:
        """The name of a 0-d array holding ``value`` (one per distinct double: -0.0 is not
        0.0)."""
        for name, array in constants.items():
            if float(array).hex() == value.hex():
                return name
        name = f"c{len(constants)}"
        constants[name] = np.array(value)
        constants[name].setflags(write=False)
        return name

    def new_rows(self, n: int) -> np.ndarray:
        """An uninitialised [size, n] array to fill (its row inputs first)."""
        return np.empty((self.size, n))


_NUMPY_NAMES = ("add", "subtract", "multiply", "divide", "minimum", "maximum", "fmod", "ceil",
                "floor", "greater_equal", "greater", "less_equal", "less", "equal", "where",
                "copyto")
