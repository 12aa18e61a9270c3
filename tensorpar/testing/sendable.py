"""A function for new processes: sent as its module and name, refused before any rank starts when a
new process could not find it (a lambda, a function inside a function, or one of a ``__main__`` that
no file holds: a REPL, stdin, ``python -c``, a notebook cell)."""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Callable
from typing import Any

FIX = ("define it at the top level of a .py file and import it, e.g. `from mywork import train`; functions "
       "defined in a REPL, on stdin, with `python -c`, in a notebook cell, inside another function or as a "
       "lambda cannot be sent to new processes")

#: A function and its arguments on their way to a rank: the function's name, and both pickled.
Packed = tuple[str, bytes]


def pack(fn: Callable[..., Any], args: tuple[Any, ...], *, caller: str) -> Packed:
    """Pickle ``fn`` and ``args`` (tensors by value) for new processes, or say why they cannot find ``fn``:
    ``TypeError`` for what has no importable name, ``ValueError`` for a ``__main__`` without a file."""
    if not callable(fn):
        raise TypeError(f"{caller} needs a function to run, got {type(fn).__name__} {fn!r}")
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    name = f"{module}.{qualname}" if qualname else repr(fn)
    if "<lambda>" in qualname:
        raise TypeError(f"{caller} cannot run the lambda `{name}`: a new process finds a function by its "
                        f"module and name, and a lambda has no name; {FIX}")
    if "<locals>" in qualname:
        raise TypeError(f"{caller} cannot run `{name}`: it is defined inside the function "
                        f"`{qualname.split('.<locals>', 1)[0]}`, where a new process cannot find it; {FIX} "
                        "(pass what it needs as arguments)")
    main = sys.modules["__main__"]  # one that new processes can import again: `python -m`, a script file
    path = getattr(main, "__file__", None)
    if module == "__main__" and not getattr(getattr(main, "__spec__", None), "name", None) and not (
            isinstance(path, str) and os.path.isfile(path) and not os.path.basename(path).startswith("ipython")):
        raise ValueError(f"{caller} cannot run `{qualname}`: it is defined in the `__main__` of an interactive "
                         f"session, stdin, `python -c` or a notebook cell, which a new process cannot import; {FIX}")
    try:
        return name, pickle.dumps((fn, args))
    except Exception as e:
        raise TypeError(f"{caller} cannot send `{name}` and its arguments to new processes "
                        f"({type(e).__name__}: {e}); for the function: {FIX}") from e


def call(packed: Packed) -> Any:
    """On a rank: the function of :func:`pack` called on its arguments, or a ``RuntimeError`` if it cannot load."""
    name, blob = packed
    try:
        fn, args = pickle.loads(blob)
    except Exception as e:
        raise RuntimeError(f"this new process cannot load `{name}` to run it ({type(e).__name__}: {e}): a "
                           f"function defined under `if __name__ == \"__main__\":` or in a module the new "
                           f"process cannot import is not found there; {FIX}") from e
    return fn(*args)
