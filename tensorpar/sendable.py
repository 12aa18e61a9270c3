"""What a new process can run: a function it can import, checked before any rank starts.

Ranks are new processes (forked from a clean fork server, see :mod:`tensorpar.launch`,
or spawned). A function reaches them as its module and name, which the rank imports; a function defined where no
file holds it cannot be found there. That is every function defined in the
``__main__`` of an interactive session, of ``python -`` (stdin), of
``python -c`` or of a notebook cell, and every lambda or function defined
inside another function. :func:`check_sendable` says so in the launching
process, naming the function and the fix; what it cannot foresee (a function
defined under ``if __name__ == "__main__":``, a module the ranks cannot
import) :func:`unpack` reports on the rank, with the same fix, in place of a
bare exit.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

FIX = ("define it at the top level of a .py file and import it, e.g. `from mywork import train`; functions "
       "defined in a REPL, on stdin, with `python -c`, in a notebook cell, inside another function or as a "
       "lambda cannot be sent to new processes")

#: A function and its arguments on their way to a rank: the function's name, and both pickled.
Packed = tuple[str, bytes]


def _target(fn: Any) -> Any:
    """The object a rank must find by module and name to rebuild ``fn``, or None for a built-in."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if isinstance(fn, types.MethodType):
        fn = fn.__self__ if isinstance(fn.__self__, type) else type(fn.__self__)
    if isinstance(fn, (types.BuiltinFunctionType, types.BuiltinMethodType)):
        return None
    return fn if isinstance(fn, (types.FunctionType, type)) else type(fn)


def describe(fn: Any) -> str:
    """``module.qualname`` of ``fn`` (or of what it wraps), for messages."""
    target = _target(fn) or fn
    module, name = getattr(target, "__module__", None), getattr(target, "__qualname__", None)
    return f"{module}.{name}" if module and name else repr(fn)


def main_reruns_in_new_processes() -> bool:
    """Whether a new process can rebuild this process's ``__main__``: it runs the same module
    (``python -m``) or the same script file again, as ``multiprocessing`` does for its ``spawn``
    start method. An interactive session, stdin, ``python -c`` and IPython have no such file."""
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None):
        return True
    path = getattr(main, "__file__", None)
    return (isinstance(path, str) and os.path.isfile(path)
            and os.path.splitext(os.path.basename(path))[0] != "ipython")  # multiprocessing skips IPython's


def check_sendable(fn: Callable[..., Any], *, caller: str) -> None:
    """Raise, before any process starts, if a new process could not find ``fn``.

    ``TypeError`` for something no process can import by name (a lambda, a function
    defined inside another function); ``ValueError`` for a function of a ``__main__``
    that new processes cannot rebuild (a REPL, stdin, ``python -c``, a notebook cell).
    ``caller`` names the API. Anything else that cannot be found by name (a decorator
    without ``functools.wraps``) fails to pickle, which :func:`pack` reports.
    """
    if not callable(fn):
        raise TypeError(f"{caller} needs a function to run, got {type(fn).__name__} {fn!r}")
    target = _target(fn)
    if target is None:
        return
    module, qualname = getattr(target, "__module__", None), getattr(target, "__qualname__", "")
    name = describe(fn)
    if "<lambda>" in qualname:
        raise TypeError(f"{caller} cannot run the lambda `{name}`: a new process finds a function by its "
                        f"module and name, and a lambda has no name; {FIX}")
    if "<locals>" in qualname:
        outer = qualname.split(".<locals>", 1)[0]
        raise TypeError(f"{caller} cannot run `{name}`: it is defined inside the function `{outer}`, where a "
                        f"new process cannot find it; {FIX} (pass what it needs as arguments)")
    if module == "__main__" and not main_reruns_in_new_processes():
        raise ValueError(f"{caller} cannot run `{qualname}`: it is defined in the `__main__` of an interactive "
                         f"session, stdin, `python -c` or a notebook cell, which a new process cannot import; {FIX}")


def pack(fn: Callable[..., Any], args: tuple[Any, ...], *, caller: str) -> Packed:
    """Check ``fn`` (:func:`check_sendable`) and pickle it with ``args`` (tensors by value)."""
    check_sendable(fn, caller=caller)
    name = describe(fn)
    try:
        return name, pickle.dumps((fn, args))
    except Exception as e:
        raise TypeError(f"{caller} cannot send `{name}` and its arguments to new processes "
                        f"({type(e).__name__}: {e}); for the function: {FIX}") from e


def unpack(packed: Packed) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """On a rank: the function and arguments of :func:`pack`; if they cannot be loaded here, a
    ``RuntimeError`` that names the function, says why and gives the fix."""
    name, blob = packed
    try:
        return pickle.loads(blob)
    except Exception as e:
        raise RuntimeError(f"this new process cannot load `{name}` to run it ({type(e).__name__}: {e}): a "
                           f"function defined under `if __name__ == \"__main__\":` or in a module the new "
                           f"process cannot import is not found there; {FIX}") from e


@contextlib.contextmanager
def missing_main_file_hidden() -> Iterator[None]:
    """While processes start: hide a ``__main__.__file__`` that names no file (``<stdin>``).

    ``multiprocessing`` would have each new process run that "file" again as its
    ``__main__`` and fail to open it before running anything, even a function
    imported from a module. Without a ``__file__`` it leaves ``__main__`` alone,
    as for ``python -c``.
    """
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    hide = (main is not None and isinstance(path, str) and not os.path.isfile(path)
            and not getattr(getattr(main, "__spec__", None), "name", None))
    if hide:
        del main.__file__  # type: ignore[union-attr]
    try:
        yield
    finally:
        if hide:
            main.__file__ = path  # type: ignore[union-attr]
