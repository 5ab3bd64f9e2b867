"""Serialization of DataFlows to LMDB, HDF5 and npz files, with a safe, versioned codec.

- :class:`LMDBSerializer` / :class:`LMDBDataset`: any codec-supported datapoint, one LMDB value each; fast
  sequential cursor reads, random access, several reader processes. ``LMDBSerializer.load`` also reads
  the files tensorpack's ``LMDBSerializer.save`` writes (:func:`decode_tensorpack` decodes their values).
- :class:`LMDBData` / :class:`LMDBDataDecoder`: tensorpack's raw ``[key, value]`` reader of any LMDB file.
- :class:`HDF5Serializer` / :class:`HDF5Data`: one chunked HDF5 dataset per component.
- :class:`NumpySerializer` / :class:`NumpyData`: one ``.npz`` file, for small datasets.
- :func:`encode` / :func:`decode` (one buffer) and :func:`encode_frames` / :func:`decode_frames` (arrays as
  separate frames, for transports): the codec; it never unpickles unless both sides ask.
- :class:`ImageFolderData`: ``root/<class>/<image>`` as ``[image, label]`` (the file's bytes as a ``uint8``
  array, or decoded).
- :func:`load`: any of the three formats, recognised by content.

Every save writes a temporary file beside the target and renames it on success (a failed write raises
:class:`DatasetWriteError` naming the target and the cause: disk full, file-size limit, read-only...); loads check the
format name, codec and version stored in the file, and raise :class:`CorruptDataError` naming the
path for damaged or foreign files.
"""

from .._codec import CODECS, DEFAULT_CODEC, FORMAT_VERSION, decode, decode_frames, encode, encode_frames, peek_codec
from .._serialize_errors import (
    ComponentNotFoundError,
    CorruptDataError,
    DatasetChangedError,
    DatasetNotFoundError,
    DatasetWriteError,
    EncodeError,
    ExternalDataError,
    PickleNotAllowedError,
    SerializationError,
    TargetExistsError,
    UnsupportedFormatError,
)
from ._atomic import atomic_path
from ._formats import detect_format, load, load_dataset
from ._hdf5_format import HDF5Data, HDF5Serializer
from ._images import ImageFolderData, image_folder, list_image_folder, read_image
from ._lmdb_format import LMDBDataset, LMDBSerializer, read_lmdb_meta
from ._lmdb_raw import LMDBData, LMDBDataDecoder, LMDBDataPoint
from ._npz_format import NumpyData, NumpySerializer
from ._tensorpack_codec import decode_tensorpack

__all__ = [
    "CODECS",
    "DEFAULT_CODEC",
    "FORMAT_VERSION",
    "ComponentNotFoundError",
    "CorruptDataError",
    "DatasetChangedError",
    "DatasetNotFoundError",
    "DatasetWriteError",
    "EncodeError",
    "ExternalDataError",
    "HDF5Data",
    "HDF5Serializer",
    "ImageFolderData",
    "LMDBData",
    "LMDBDataDecoder",
    "LMDBDataPoint",
    "LMDBDataset",
    "LMDBSerializer",
    "NumpyData",
    "NumpySerializer",
    "PickleNotAllowedError",
    "SerializationError",
    "TargetExistsError",
    "UnsupportedFormatError",
    "atomic_path",
    "decode",
    "decode_frames",
    "decode_tensorpack",
    "detect_format",
    "encode",
    "encode_frames",
    "image_folder",
    "list_image_folder",
    "load",
    "load_dataset",
    "peek_codec",
    "read_image",
    "read_lmdb_meta",
]
