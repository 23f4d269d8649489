"""Limits on rendering a chat template, which is untrusted code from a model folder.

Jinja2's sandbox stops a template from reaching Python internals, but not from spending memory or time:
`{{ 'x' * 3000000000 }}` allocates 3 GB, two nested `range(100000)` loops run for hours, and `{% include %}`
died with a TypeError (the environment has no loader). `LimitedEnvironment` refuses each of these as a
`TemplateLimitError` (a jinja2 TemplateError, so the renderer reports it as one line):

  size   a `*`, `+` or `%` whose result would exceed MAX_SIZE characters (or items), an integer argument
         above MAX_SIZE to a method or filter (`'x'.ljust(10**10)`, `'x'|center(10**10)`), a format width
         of 8 or more digits, a power with a large exponent; nothing is constant-folded at compile time (the
         optimizer would compute `'x' * 3000000000` while compiling);
  time   `render_limited` runs the render under a tracer that checks a deadline (MAX_SECONDS) on every line
         the template executes, so a loop of any kind stops; code outside the template runs untraced;
  files  include / import / extends find no template.
"""

from __future__ import annotations

import functools
import re
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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


def _size(x: Any) -> int | None:
    return len(x) if isinstance(x, (str, bytes, list, tuple)) else None


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
        if operator_ == "*":
            n, count = (_size(left), right) if _size(left) is not None else (_size(right), left)
            if n is not None and isinstance(count, int) and n * count > MAX_SIZE:
                raise TemplateLimitError(f"a repetition of {n} x {count} is over the size limit ({MAX_SIZE})")
        elif operator_ == "+":
            if _size(left) is not None and _size(right) is not None and _size(left) + _size(right) > MAX_SIZE:
                raise TemplateLimitError(f"a concatenation over the size limit ({MAX_SIZE})")
        elif operator_ == "%":
            if isinstance(left, str) and _BIG_WIDTH.search(left):
                raise TemplateLimitError("a format width over the size limit")
        elif operator_ == "**":
            if isinstance(right, int) and abs(right) > 64 and isinstance(left, (int, float)) and abs(left) > 1:
                raise TemplateLimitError(f"a power with exponent {right} is over the size limit")
        return super().call_binop(context, operator_, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's)
        _check_args(args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)


@contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Check the clock on every line a template's compiled code runs (only its frames are traced line by
    line: their file is "<template>"); a tracer already installed (coverage, a debugger) is restored after."""
    end = time.monotonic() + seconds

    def local(frame: Any, event: str, arg: Any) -> Any:
        if time.monotonic() > end:
            raise TemplateLimitError(f"rendering took longer than {seconds:g} s")
        return local

    def enter(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename != "<template>":
            return None
        return local(frame, event, arg)

    previous = sys.gettrace()
    sys.settrace(enter)
    try:
        yield
    finally:
        sys.settrace(previous)


def render_limited(blocks: Iterator[str], out: list[str], *, seconds: float | None = None) -> None:
    """Drain a template's `generate()` into `out` under the time limit, refusing output past MAX_SIZE
    characters (`out` grows block by block: the `{% generation %}` tag reads what is already there)."""
    total = 0
    with _deadline(MAX_SECONDS if seconds is None else seconds):
        for block in blocks:
            total += len(block)
            if total > MAX_SIZE:
                raise TemplateLimitError(f"the rendered text is over the size limit ({MAX_SIZE} characters)")
            out.append(block)
