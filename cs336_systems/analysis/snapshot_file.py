"""Reading an allocator snapshot file (a torch.cuda.memory._snapshot pickle) without running its code.

`pickle.load` runs whatever a pickle names: a snapshot received from someone else (they are shared for
PyTorch's memory viewer) could run arbitrary code on load. A snapshot is plain data (dicts, lists, strings,
numbers, booleans, None), which pickle encodes without naming any callable, so `load_snapshot` refuses every
global a pickle asks for except the built-in containers pickle protocols before 4 name (set, frozenset) and
plain numbers and strings. A refused file raises pickle.UnpicklingError naming the file and what it asked for.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

# The only globals a snapshot pickle may name: plain containers and values (protocols 0-3 write a set as a call
# to builtins.set; a complex or a bytearray likewise).
ALLOWED_GLOBALS = frozenset((module, name) for module in ("builtins", "__builtin__")  # protocol 3, and 0-2
                             for name in ("set", "frozenset", "bytearray", "complex", "int", "float", "str", "bytes",
                                          "bool"))


class _PlainDataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"{module}.{name} is not plain data")
        return super().find_class(module, name)


def loads_snapshot(data: bytes, source: str = "snapshot") -> dict:
    """A snapshot from pickle bytes, only if they hold plain data (see the module docstring)."""
    try:
        snapshot = _PlainDataUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as error:
        raise pickle.UnpicklingError(f"{source} is refused: it asks for {error}, and a snapshot holds only plain "
                                     "containers, numbers and strings (a pickle that names code could run it)")
    if not isinstance(snapshot, dict):
        raise pickle.UnpicklingError(f"{source} holds a {type(snapshot).__name__}, not a snapshot (a dict)")
    return snapshot


def load_snapshot(path: str | Path) -> dict:
    """The snapshot in the pickle file at path, read with the restricted unpickler."""
    return loads_snapshot(Path(path).read_bytes(), f"snapshot {str(path)!r}")
