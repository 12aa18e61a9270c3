"""What Linux's ``/proc`` says about a process or one of its threads."""

from __future__ import annotations


def process_state(pid: int | str, thread: int | str | None = None) -> str:
    """The one-letter state (``R``, ``S``, ``Z``...) of process ``pid`` (``"self"``: this one), or of its
    thread ``thread``; ``"X"`` when it is gone (or there is no ``/proc``)."""
    path = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
    try:
        with open(path) as f:
            return f.read().rsplit(")", 1)[1].split()[0]  # after the name, which may hold spaces and ")"
    except (OSError, IndexError):
        return "X"


def thread_name(thread: int | str, pid: int | str = "self") -> str | None:
    """The name of thread ``thread`` of process ``pid`` (``None`` when it is gone)."""
    try:
        with open(f"/proc/{pid}/task/{thread}/comm") as f:
            return f.read().strip()
    except OSError:
        return None
