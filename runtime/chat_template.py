"""Render an export's chat template in a sandbox with a time limit and a size limit.

A chat template is code that came with the folder. Jinja2's immutable sandbox already keeps it away from Python's
internals and from mutating its inputs, and caps ``range()`` at 100,000 items; it does not stop a template that
loops for hours (``range(100000)`` nested twice) or doubles a string until memory is gone. So, on top of it:

    time    a trace function (``sys.settrace``, this thread, during the render only) checks a deadline at every line
            the compiled template runs, loops included                                          MAX_SECONDS
    size    every value that can grow is checked before it is made: ``*`` and ``**``, ``~`` concatenation (through
            the code generator), ``+``, ``%``, every filter and method call (integer arguments such as ``center``'s
            width, ``join`` and ``replace`` by the size of their result), and the rendered text       max_chars
Going over either is a ChatTemplateError, as are syntax errors and errors raised while rendering.
"""
from __future__ import annotations

import functools
import re
import sys
import time

from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mirrorsd.errors import ChatTemplateError, MirrorSDError

MAX_INT_BITS = 1 << 16  # integers in a chat template count messages and tokens; 2^65536 is far past any of that
MAX_SECONDS = 2.0  # real chat templates render in about a millisecond
BASE_CHARS = 1_000_000  # allowed on top of twice the messages' own text: a template adds markup, never megabytes


class _TooMuch(Exception):
    """The template went over the time or size limit (raised inside the render, turned into ChatTemplateError)."""


class _CheckedConcat(CodeGenerator):
    """Compiles ``a ~ b`` to a size-checked join (Jinja2's own code calls an unchecked one)."""

    def visit_Concat(self, node, frame) -> None:
        self.write("environment.checked_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class LimitedSandbox(ImmutableSandboxedEnvironment):
    """Jinja2's immutable sandbox, with every operation that can grow a value checked against ``max_chars``."""

    code_generator_class = _CheckedConcat
    intercepted_binops = frozenset(["*", "**", "+", "%"])

    def __init__(self, max_chars: int, **options) -> None:
        super().__init__(**options)
        self.max_chars = max_chars
        self.filters = {name: self._checked(f) for name, f in self.filters.items()}

    def size(self, value) -> None:
        if isinstance(value, (str, bytes, list, tuple, dict)) and len(value) > self.max_chars:
            raise _TooMuch(f"a value of {len(value):,} items (the limit is {self.max_chars:,})")

    def _numbers(self, args) -> None:
        for arg in args:
            if isinstance(arg, int) and not isinstance(arg, bool) and abs(arg) > self.max_chars:
                raise _TooMuch(f"the number {arg} (the limit is {self.max_chars:,})")

    def checked_concat(self, parts) -> str:
        if sum(len(str(p)) for p in parts) > self.max_chars:
            raise _TooMuch(f"a ~ concatenation longer than {self.max_chars:,} characters")
        return "".join(str(p) for p in parts)

    def call_binop(self, context, operator, left, right):
        if operator in ("*", "**") and isinstance(left, int) and isinstance(right, int):
            bits = left.bit_length() * (abs(right) if operator == "**" else 1) + right.bit_length()
            if bits > MAX_INT_BITS:
                raise _TooMuch(f"an integer of about {bits:,} bits")
        if operator == "%" and isinstance(left, str):
            self._widths(left)
        if operator == "*":
            count = right if isinstance(right, int) else left if isinstance(left, int) else None
            seq = left if count is right else right
            if count is not None and hasattr(seq, "__len__") and len(seq) * count > self.max_chars:
                raise _TooMuch(f"a repetition {len(seq)} x {count}")
        result = super().call_binop(context, operator, left, right)
        self.size(result)
        return result

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - Jinja2's signature
        __self._numbers(list(args) + list(kwargs.values()))
        method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
        __self._predict(getattr(method, "__name__", ""), getattr(method, "__self__", None), args)
        result = super().call(__context, __obj, *args, **kwargs)
        __self.size(result)
        return result

    def _widths(self, text: str) -> None:
        """A format string's field widths ("%999999999d", "{:999999999}") make a string that wide."""
        self._numbers(int(digits) for digits in re.findall(r"\d{7,}", text))

    def _predict(self, name: str, owner, args) -> None:
        """``join``, ``replace`` and ``format`` can make a result far larger than their inputs: check it first."""
        if name in ("format", "format_map") and isinstance(owner, str):
            self._widths(owner)
            return
        if name == "join" and isinstance(owner, str) and args and isinstance(args[0], (list, tuple)):
            total = sum(len(str(x)) for x in args[0]) + len(owner) * len(args[0])
        elif name == "replace" and isinstance(owner, str) and len(args) >= 2:
            old, new = str(args[0]), str(args[1])
            total = len(owner) + (owner.count(old) if old else len(owner) + 1) * len(new)
        else:
            return
        if total > self.max_chars:
            raise _TooMuch(f"a {name} result of {total:,} characters")

    def _checked(self, f):
        @functools.wraps(f)
        def filter_(*args, **kwargs):
            self._numbers([a for a in list(args)[1:] + list(kwargs.values())])
            value = next((a for a in args if isinstance(a, str)), None)
            if f.__name__.endswith("format") and isinstance(value, str):
                self._widths(value)
            if f.__name__.endswith("replace") and isinstance(value, str) and len(args) >= 3:
                self._predict("replace", value, args[args.index(value) + 1:])
            if f.__name__.endswith("join") and args:
                items = next((a for a in args if isinstance(a, (list, tuple))), None)
                if items is not None:
                    self._predict("join", "", (items,))
            result = f(*args, **kwargs)
            self.size(result)
            return result
        return filter_


def render(template: str, max_chars: int = BASE_CHARS, seconds: float = MAX_SECONDS,
           globals_: dict | None = None, **variables) -> str:
    """Render ``template`` with ``variables`` in the limited sandbox; ChatTemplateError on any failure or limit."""
    env = LimitedSandbox(max_chars, trim_blocks=True, lstrip_blocks=True)
    env.globals.update(globals_ or {})
    try:
        return _render_in_time(env, template, max_chars, seconds, variables)
    except MirrorSDError:
        raise  # raise_exception() in the template: the template's own message
    except _TooMuch as exc:
        raise ChatTemplateError("The chat template went over the sandbox's limits", str(exc),
                                "do not use this folder's chat template: pass --raw, or re-export the model") from None
    except Exception as exc:  # noqa: BLE001 - the template is the folder's code: whatever it raises is its fault
        raise ChatTemplateError("The export's chat template cannot be rendered", f"{type(exc).__name__}: {exc}",
                                "pass --raw (plain completion), or re-export the model with a working template") \
            from None


def _render_in_time(env: LimitedSandbox, template: str, max_chars: int, seconds: float, variables: dict) -> str:
    compiled = env.from_string(template)
    deadline = time.perf_counter() + seconds

    def tracer(frame, event, arg):
        if time.perf_counter() > deadline:
            raise _TooMuch(f"rendering took longer than {seconds:g} s")
        return tracer

    pieces, length = [], 0
    previous = sys.gettrace()
    sys.settrace(tracer)  # this thread only; every frame the render opens checks the deadline on every line
    try:
        for piece in compiled.generate(**variables):
            length += len(piece)
            if length > max_chars:
                raise _TooMuch(f"its output passed {max_chars:,} characters")
            pieces.append(piece)
    finally:
        sys.settrace(previous)
    return "".join(pieces)
