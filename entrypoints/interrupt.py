"""Ctrl-C in the CLI, taken where pagedllm waits rather than wherever the main thread is.

Python raises KeyboardInterrupt at whatever bytecode runs when SIGINT lands. Inside library
code that runs Python from C/Rust (imports, tokenizer loading) it can be swallowed (the command
then finishes as if never interrupted) or leave CPython's "unhandled KeyboardInterrupt" flag set
after we handled it (the process then dies by SIGINT instead of exiting 130). So the CLI's
handler only notes the signal, and the engine client's wait loops raise it from our own code,
within one poll interval. A second Ctrl-C raises at once, as usual.
"""

from __future__ import annotations

import signal

_pending = False


def _note(signum, frame) -> None:
    global _pending
    _pending = True
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the next one is not deferred


def defer_sigint() -> None:
    """Install the noting handler (main thread only)."""
    global _pending
    _pending = False
    signal.signal(signal.SIGINT, _note)


def raise_if_interrupted() -> None:
    global _pending
    if _pending:
        _pending = False
        raise KeyboardInterrupt
