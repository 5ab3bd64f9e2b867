"""Import optional dependencies where they are used, with an error that says how to install them.

The one place that knows which extra of setup.cfg provides which module, and the command that installs it.
That command works as printed from any folder: it names the packages with setup.cfg's version bounds (not
``pip install -e ".[extra]"``, which works only inside the checkout, and not ``pip install bridgeflow[extra]``:
the name ``bridgeflow`` on PyPI is an unrelated project); torch's is the CPU build's, since a plain
``pip install torch`` on Linux pulls a multi-GB CUDA build. tests/test_deps.py holds :data:`EXTRAS` equal to
setup.cfg's.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ._errors import MissingDependencyError

__all__ = ["EXTRAS", "install_hint", "require"]

# setup.cfg's [options.extras_require] for the optional packages the library imports (not the test, docs or
# all extras): extra -> requirements
EXTRAS: dict[str, tuple[str, ...]] = {
    "lmdb": ("lmdb>=1.3", "zlib-ng>=0.4"),
    "hdf5": ("h5py>=3.6",),
    "msgpack": ("msgpack>=1.0",),
    "zmq": ("pyzmq>=24",),
    "ray": ("ray>=2.9",),
    "images": ("opencv-python-headless>=4.5", "pillow>=9"),
    "torch": ("torch>=2.11",),
    "tensorflow": ("tensorflow-cpu>=2.15",),
}

# top-level module -> the extra that installs it
_MODULES = {"lmdb": "lmdb", "zlib_ng": "lmdb", "h5py": "hdf5", "msgpack": "msgpack", "zmq": "zmq", "ray": "ray",
            "cv2": "images", "PIL": "images", "torch": "torch", "tensorflow": "tensorflow"}

_TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def install_hint(module: str) -> str:
    """The command that installs ``module`` (a top-level name: ``"lmdb"``, ``"cv2"``), runnable from any folder,
    with the extra it belongs to: ``'pip install "h5py>=3.6"' (bridgeflow's "hdf5" extra)``.

    Example:
        >>> print(install_hint("h5py"))
        pip install "h5py>=3.6"  (bridgeflow's "hdf5" extra)
        >>> print(install_hint("torch"))  # doctest: +NORMALIZE_WHITESPACE
        pip install "torch>=2.11" --index-url https://download.pytorch.org/whl/cpu  (bridgeflow's "torch" extra,
        the CPU build; a CUDA build: https://pytorch.org/get-started/locally/)
    """
    top = module.split(".")[0]
    extra = _MODULES.get(top)
    if extra is None:
        return f"pip install {top}"
    packages = " ".join(f'"{r}"' for r in EXTRAS[extra])
    if extra == "torch":
        return (f"pip install {packages} --index-url {_TORCH_CPU_INDEX}  (bridgeflow's \"torch\" extra, the CPU "
                "build; a CUDA build: https://pytorch.org/get-started/locally/)")
    return f'pip install {packages}  (bridgeflow\'s "{extra}" extra)'


def require(module: str, feature: str = "") -> ModuleType:
    """Import ``module`` or raise :class:`MissingDependencyError` naming the extra that provides it and the
    command that installs it.

    Example:
        >>> require("json").dumps([1])
        '[1]'
        >>> require("no_such_module", "MyReader")
        Traceback (most recent call last):
        bridgeflow._errors.MissingDependencyError: MyReader needs no_such_module, which is not installed; ...
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        who = f"{feature} needs {top}" if feature else top
        missing = isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == top
        what = (f"{who}, which is not installed" if missing
                else f"{who}, which is installed but does not import ({type(exc).__name__}: {exc})")
        raise MissingDependencyError(f"{what}; install it with: {install_hint(top)}") from exc
