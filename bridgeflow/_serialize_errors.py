"""Errors raised by bridgeflow.serialize and the codec; all derive from :class:`bridgeflow._errors.BridgeflowError`.

They sit in the lowest layer, beside :mod:`bridgeflow._errors`: the codec (:mod:`bridgeflow._codec`), which the
state uses to keep held datapoints, raises them too. Users import them from :mod:`bridgeflow.serialize`.
"""

from __future__ import annotations

from ._errors import BridgeflowError

__all__ = [
    "ComponentNotFoundError",
    "CorruptDataError",
    "DatasetChangedError",
    "DatasetNotFoundError",
    "DatasetWriteError",
    "EncodeError",
    "ExternalDataError",
    "PickleNotAllowedError",
    "SerializationError",
    "TargetExistsError",
    "UnsupportedFormatError",
]


class SerializationError(BridgeflowError):
    """Base class of the errors raised while encoding, decoding, saving or loading datasets."""


class CorruptDataError(SerializationError, ValueError):
    """Bytes that are not a valid encoding, or a dataset file that is truncated, corrupt or of another format.

    File errors name the path; the original low-level error (``lmdb.Error``, ``OSError``) is the cause.
    """


class ExternalDataError(SerializationError, ValueError):
    """A dataset file whose data lies outside it: an HDF5 external link, a soft link leading out through
    one, raw data stored in other files, or a virtual dataset. Such a file could make the reader read any
    file the process can (``/etc/passwd`` as images), so it is refused unless the caller vouches for it
    (``allow_external=True``, ``--allow-external``). The message names the file, the dataset and what it
    points at."""


class UnsupportedFormatError(SerializationError, ValueError):
    """A valid file or buffer written with a codec or format version this bridgeflow does not know."""


class PickleNotAllowedError(SerializationError, ValueError):
    """Data written with ``codec="pickle"`` read without ``allow_pickle=True`` (pickle can run code)."""


class EncodeError(SerializationError, TypeError):
    """An object the codec cannot store; the message names where it sits inside the datapoint."""


class TargetExistsError(SerializationError, FileExistsError):
    """``save`` would replace an existing file; pass ``overwrite=True`` to allow it."""


class DatasetWriteError(SerializationError, OSError):
    """Writing a dataset file failed: the message names the target file and the cause the system gave
    (``errno``: ``ENOSPC`` disk full, ``EFBIG`` past the file-size limit, ``EROFS`` read-only, ``EDQUOT``,
    ``EACCES``...); ``filename`` is the target. Nothing was left at the target's path (the temporary file
    is removed), and an existing file there is kept."""

    def __str__(self) -> str:
        return str(self.strerror)  # the message names the target and the errno already


class DatasetNotFoundError(SerializationError, FileNotFoundError):
    """``load`` of a path that does not exist."""


class DatasetChangedError(SerializationError):
    """The file a reader reads changed under it: a reader used in another process (or after ``close()``)
    finds another file at its path than the one it was opened on (replaced or removed), or another
    process committed to the LMDB file since the reader opened it (it is being written: a value read now
    could be another key's). Load the path again to read the file as it is now."""


class ComponentNotFoundError(SerializationError, KeyError):
    """``data_paths`` names a component or dataset the file does not have."""
