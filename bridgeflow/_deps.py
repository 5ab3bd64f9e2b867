"""Import optional dependencies where they are used, with an error that says how to install them."""

from __future__ import annotations

import importlib
from types import ModuleType

from ._errors import MissingDependencyError

# module name -> (extra, pip distribution)
_EXTRAS = {
    "lmdb": ("lmdb", "lmdb"),
    "h5py": ("hdf5", "h5py"),
    "msgpack": ("msgpack", "msgpack"),
    "zmq": ("zmq", "pyzmq"),
    "ray": ("ray", "ray"),
    "torch": ("torch", "torch"),
    "tensorflow": ("tensorflow", "tensorflow-cpu"),
    "cv2": ("images", "opencv-python-headless"),
    "PIL": ("images", "pillow"),
}


def require(module: str, feature: str = "") -> ModuleType:
    """Import ``module`` or raise :class:`MissingDependencyError` naming the extra that provides it.

    Example:
        >>> require("json").dumps([1])
        '[1]'
        >>> require("no_such_module", "MyReader")
        Traceback (most recent call last):
        bridgeflow._errors.MissingDependencyError: MyReader needs no_such_module; install it with: ...
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        extra, dist = _EXTRAS.get(module.split(".")[0], (None, module))
        what = f"{feature} needs {dist}" if feature else f"{dist} is not installed"
        hint = f'pip install -e ".[{extra}]"' if extra else f"pip install {dist}"
        raise MissingDependencyError(f"{what}; install it with: {hint}") from exc
