"""Limits on rendering a chat template, which is untrusted code from a model folder.

Jinja2's sandbox stops a template from reaching Python internals, but not from spending memory or time:
`{{ 'x' * 3000000000 }}` allocates 3 GB, two nested `range(100000)` loops run for hours, and `{% include %}`
raises a TypeError in an environment without a loader. `LimitedEnvironment` refuses each of these as a
`TemplateLimitError` (a jinja2 TemplateError, so the renderer reports it as one line):

  size   a `*`, `+` or `%` whose result would exceed MAX_SIZE characters (or items), an integer argument
         above MAX_SIZE to a method or filter (`'x'.ljust(10**10)`, `'x'|center(10**10)`), a format width
         of 8 or more digits, a power with a large exponent; nothing is constant-folded at compile time (the
         optimizer would compute `'x' * 3000000000` while compiling);
  time   `render_limited` stops a render that runs past MAX_SECONDS (an exception raised in its thread by a
         timer), so a loop of any kind stops;
  files  include / import / extends find no template.
"""

from __future__ import annotations

import ctypes
import functools
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_SIZE = 10_000_000  # characters of one string (or items of one list) a template may build
MAX_SECONDS = 5.0  # a chat template renders in milliseconds; this is a runaway loop
_BIG_WIDTH = re.compile(r"\d{8,}")  # a format width / precision of 10**7 or more


class TemplateLimitError(jinja2.exceptions.TemplateError):
    """A chat template went past a size or time limit."""


def _sized(x: Any) -> bool:
    return isinstance(x, (str, bytes, list, tuple))


def _check_args(args: tuple, kwargs: dict) -> None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_SIZE:
            raise TemplateLimitError(f"an argument of {a} is over the size limit ({MAX_SIZE})")


def _limited_filter(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)  # keeps jinja's pass_context / pass_environment marks
    def filtered(*args: Any, **kwargs: Any) -> Any:
        _check_args(args[1:], kwargs)  # the first argument is the filtered value (or the context)
        if args and isinstance(args[0], str) and _BIG_WIDTH.search(args[0]) and fn.__name__ == "do_format":
            raise TemplateLimitError("a format width over the size limit")
        return fn(*args, **kwargs)

    return filtered


class _NoFiles(jinja2.BaseLoader):
    def get_source(self, environment: Any, template: str) -> Any:
        raise TemplateLimitError(f"it includes, imports or extends {template!r}: a chat template is one file")


class _LimitedCodeGenerator(CodeGenerator):
    """`a ~ b` (a Concat, not a binop, so not intercepted) joins through the environment's size check."""

    def visit_Concat(self, node: nodes.Concat, frame: Any) -> None:
        if frame.eval_ctx.volatile or frame.eval_ctx.autoescape:
            return super().visit_Concat(node, frame)
        self.write("environment.join_limited((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class LimitedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox of `transformers`, with the size limits above and no template files."""

    intercepted_binops = frozenset({"*", "+", "%", "**"})
    code_generator_class = _LimitedCodeGenerator

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(optimized=False, loader=_NoFiles(), **kwargs)
        self.filters = {name: _limited_filter(f) for name, f in self.filters.items()}

    def join_limited(self, parts: tuple) -> str:
        texts = [str(p) for p in parts]
        if sum(len(t) for t in texts) > MAX_SIZE:
            raise TemplateLimitError(f"a concatenation over the size limit ({MAX_SIZE})")
        return "".join(texts)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        # str.format is wrapped when it is looked up (jinja's sandbox), before call() sees it
        if isinstance(getattr(value, "__self__", None), str) and _BIG_WIDTH.search(value.__self__):
            raise TemplateLimitError("a format width over the size limit")
        return super().wrap_str_format(value)

    def call_binop(self, context: Any, operator_: str, left: Any, right: Any) -> Any:
        # on every `+` of a template's text: kept to a few cheap checks
        if operator_ == "+":
            if type(left) is str and type(right) is str or _sized(left) and _sized(right):
                if len(left) + len(right) > MAX_SIZE:
                    raise TemplateLimitError(f"a concatenation over the size limit ({MAX_SIZE})")
        elif operator_ == "*":
            seq, count = (left, right) if _sized(left) else (right, left)
            if _sized(seq) and isinstance(count, int) and len(seq) * count > MAX_SIZE:
                raise TemplateLimitError(
                    f"a repetition of {len(seq)} x {count} is over the size limit ({MAX_SIZE})"
                )
        elif operator_ == "%":
            if isinstance(left, str) and _BIG_WIDTH.search(left):
                raise TemplateLimitError("a format width over the size limit")
        elif operator_ == "**":
            if (
                isinstance(right, int)
                and abs(right) > 64
                and isinstance(left, (int, float))
                and abs(left) > 1
            ):
                raise TemplateLimitError(f"a power with exponent {right} is over the size limit")
        return super().call_binop(context, operator_, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's)
        _check_args(args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)


class _Expired(BaseException):
    """Raised in the rendering thread when its time is up (a BaseException: the template's code cannot
    catch it)."""


def _with_deadline(fn: Callable[[], None], seconds: float) -> None:
    """Run fn(); past `seconds`, a timer thread raises _Expired in this thread (CPython's
    PyThreadState_SetAsyncExc), which stops a loop of any kind at its next bytecode; then TemplateLimitError.
    Nothing is traced: a render within its time costs one timer thread. Once fn has returned the timer can no
    longer fire (the lock), and an exception it set but that was not yet raised is withdrawn."""
    thread, lock, state = threading.get_ident(), threading.Lock(), {"done": False, "fired": False}

    def expire() -> None:
        with lock:
            if not state["done"]:
                state["fired"] = True
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), ctypes.py_object(_Expired))

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        try:
            fn()
        finally:
            with lock:
                state["done"] = True
                if state["fired"]:  # set but perhaps not raised yet: withdrawn
                    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), None)
            timer.cancel()
    except _Expired:
        raise TemplateLimitError(f"rendering took longer than {seconds:g} s") from None


def render_limited(blocks: Iterator[str], out: list[str], *, seconds: float | None = None) -> None:
    """Drain a template's `generate()` into `out` under the time limit, refusing output past MAX_SIZE
    characters (`out` grows block by block: the `{% generation %}` tag reads what is already there)."""

    def drain() -> None:
        total = 0
        for block in blocks:
            total += len(block)
            if total > MAX_SIZE:
                raise TemplateLimitError(f"the rendered text is over the size limit ({MAX_SIZE} characters)")
            out.append(block)

    _with_deadline(drain, MAX_SECONDS if seconds is None else seconds)
