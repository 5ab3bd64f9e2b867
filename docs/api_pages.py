"""The API reference's table of contents: which public name is described on which page, and in what order.

Each name is written as users import it and appears here once. A name that is also importable elsewhere
(``bridgeflow.serialize.LMDBSerializer`` is ``bridgeflow.LMDBSerializer``; every name of ``bridgeflow`` is
also ``bridgeflow.dataflow.<name>``, tensorpack's import path) is not listed again: ``apigen.py`` finds its
other paths and shows them on its entry. ``tests/test_docs_reference.py`` fails when a name exported by one
of the ``NAMESPACES`` is missing here or listed twice, so a new export cannot drop out of the reference.
"""

from __future__ import annotations

# The modules users import names from (what the README and the guide pages tell them to import). Every
# other module is internal: it is not in the reference, only in the contributors' module map.
NAMESPACES = (
    "bridgeflow",
    "bridgeflow.dataflow",
    "bridgeflow.parallel",
    "bridgeflow.pipeline",
    "bridgeflow.serialize",
    "bridgeflow.remote",
    "bridgeflow.imgaug",
    "bridgeflow.dataset",
    "bridgeflow.testing",
    "bridgeflow.adapters.torch",
    "bridgeflow.adapters.tensorflow",
)

# page -> (title, introduction (reStructuredText), {section title: [names]})
PAGES: dict[str, tuple[str, str, dict[str, list[str]]]] = {
    "flows": ("DataFlow and sources", """
A pipeline is a tree of flows: a source at the leaves, wrappers above it. Every flow has the same lifecycle
(:doc:`../lifecycle`): ``reset_state()`` once in the process that iterates, then ``iter()`` once per epoch,
then ``close()``.
""", {
        "The DataFlow": ["bridgeflow.DataFlow", "bridgeflow.ProxyDataFlow", "bridgeflow.RNGDataFlow",
                         "bridgeflow.iter_flows"],
        "Sources": ["bridgeflow.DataFromList", "bridgeflow.DataFromGenerator", "bridgeflow.DataFromIterable",
                    "bridgeflow.as_dataflow", "bridgeflow.FakeData", "bridgeflow.DataFromQueue"],
        "Random numbers": ["bridgeflow.get_rng", "bridgeflow.worker_seed_scope", "bridgeflow.sample_scope"],
    }),
    "transforms": ("Transforms", """
Wrappers that change, drop, repeat, combine or reorder the datapoints of another flow. They run where the
flow is iterated; put a :doc:`parallel stage <parallel>` around the expensive ones.
""", {
        "Per datapoint": ["bridgeflow.MapData", "bridgeflow.MapDataComponent", "bridgeflow.FilterData",
                          "bridgeflow.SelectComponent", "bridgeflow.PrintData"],
        "Repeating, caching, cutting": ["bridgeflow.RepeatedData", "bridgeflow.RepeatedDataPoint",
                                        "bridgeflow.CacheData", "bridgeflow.FixedSizeData"],
        "Combining flows": ["bridgeflow.ConcatData", "bridgeflow.JoinData", "bridgeflow.RandomChooseData",
                            "bridgeflow.RandomMixData"],
        "Shuffling": ["bridgeflow.LocallyShuffleData"],
        "Sharding": ["bridgeflow.ShardData", "bridgeflow.rank_and_world", "bridgeflow.UnshardedWarning"],
    }),
    "batching": ("Batching", """
Stack datapoints into batches (or split batches back), anywhere in a pipeline: placed inside a parallel stage,
batches are built in the workers' shared memory and arrive without a copy.
""", {
        "Batching": ["bridgeflow.BatchData", "bridgeflow.BatchDataByShape", "bridgeflow.UnbatchData",
                     "bridgeflow.batch_datapoints"],
    }),
    "parallel": ("Parallel stages", """
Run a function (a *map stage*) or whole flows (a *runner*) in worker processes or threads; arrays travel
through shared memory. How to choose and tune them: :doc:`../parallel`.
""", {
        "Map stages": ["bridgeflow.MultiProcessMapData", "bridgeflow.MultiThreadMapData",
                       "bridgeflow.MultiProcessMapAndBatchData"],
        "Runners": ["bridgeflow.MultiProcessRunner", "bridgeflow.MultiThreadRunner",
                    "bridgeflow.MultiProcessRunnerZMQ", "bridgeflow.MultiProcessPrefetchData",
                    "bridgeflow.MultiThreadPrefetchData"],
        "tensorpack's other names": ["bridgeflow.MultiProcessMapDataZMQ", "bridgeflow.ThreadedMapData"],
        "Measuring": ["bridgeflow.TestDataSpeed", "bridgeflow.collect_stats", "bridgeflow.pipeline.bottleneck",
                      "bridgeflow.pipeline.format_stats", "bridgeflow.OversubscribedWarning"],
        "The worker pool": ["bridgeflow.WorkerPool", "bridgeflow.parallel.WorkerContext",
                            "bridgeflow.parallel.EXHAUSTED", "bridgeflow.parallel.RemoteError",
                            "bridgeflow.parallel.MappingHooks"],
    }),
    "state": ("State and resuming", """
Every flow saves where it is with ``state_dict()`` and continues from there with ``load_state_dict()``
(:meth:`bridgeflow.DataFlow.state_dict`), exactly, through parallel stages too; the torch
:class:`~bridgeflow.adapters.torch.DataLoader` does the same for a training loop. How: :doc:`../resuming`.
A state that does not fit the flow is refused with one of these errors.
""", {
        "Errors": ["bridgeflow.StateError", "bridgeflow.StateMismatchError", "bridgeflow.NotResumableError"],
    }),
    "serialization": ("Serialization", """
Write any flow once to an LMDB, HDF5 or npz file and read it back fast, with random access. The files record
their codec and format version; the default codec never unpickles. How: :doc:`../serialization`.
""", {
        "LMDB": ["bridgeflow.LMDBSerializer", "bridgeflow.LMDBDataset", "bridgeflow.LMDBData",
                 "bridgeflow.LMDBDataDecoder", "bridgeflow.LMDBDataPoint", "bridgeflow.serialize.read_lmdb_meta",
                 "bridgeflow.serialize.decode_tensorpack"],
        "HDF5 and npz": ["bridgeflow.HDF5Serializer", "bridgeflow.HDF5Data", "bridgeflow.NumpySerializer",
                         "bridgeflow.NumpyData"],
        "Any format": ["bridgeflow.load_dataset", "bridgeflow.serialize.detect_format"],
        "Image folders": ["bridgeflow.serialize.ImageFolderData", "bridgeflow.serialize.list_image_folder",
                          "bridgeflow.serialize.read_image"],
        "The codec": ["bridgeflow.serialize.encode", "bridgeflow.serialize.decode",
                      "bridgeflow.serialize.encode_frames", "bridgeflow.serialize.decode_frames",
                      "bridgeflow.serialize.peek_codec", "bridgeflow.serialize.CODECS",
                      "bridgeflow.serialize.DEFAULT_CODEC", "bridgeflow.serialize.FORMAT_VERSION"],
        "Writing files": ["bridgeflow.serialize.atomic_path"],
        "Errors": ["bridgeflow.SerializationError", "bridgeflow.CorruptDataError", "bridgeflow.DatasetChangedError",
                   "bridgeflow.DatasetNotFoundError", "bridgeflow.TargetExistsError",
                   "bridgeflow.serialize.DatasetWriteError", "bridgeflow.serialize.EncodeError",
                   "bridgeflow.serialize.PickleNotAllowedError", "bridgeflow.serialize.UnsupportedFormatError",
                   "bridgeflow.serialize.ComponentNotFoundError", "bridgeflow.serialize.ExternalDataError"],
    }),
    "cli": ("The command line", """
``bridgeflow COMMAND --help`` prints what follows; the options of every command, as this version's parser
gives them. What the commands are for: :doc:`../serialization`.
""", {}),
    "torch": ("PyTorch", """
``bridgeflow.adapters.torch`` (importing it imports torch): a drop-in ``torch.utils.data.DataLoader`` on
bridgeflow's workers and a CUDA-stream prefetcher. How: :doc:`../torch`.
""", {
        "Loading": ["bridgeflow.adapters.torch.DataLoader", "bridgeflow.adapters.torch.CUDAPrefetcher",
                    "bridgeflow.adapters.torch.AllRanksState"],
        "Errors and warnings": ["bridgeflow.adapters.torch.LoaderStateError",
                                "bridgeflow.adapters.torch.ResumeStateError",
                                "bridgeflow.adapters.torch.DeviceUnavailableError",
                                "bridgeflow.adapters.torch.UnsplitFlowWarning",
                                "bridgeflow.adapters.torch.DoubleShuffleWarning"],
    }),
    "tensorflow": ("TensorFlow", """
``bridgeflow.adapters.tensorflow`` (importing it imports TensorFlow): queue, staging and ``tf.data`` inputs
fed from any flow while the model trains. How: :doc:`../tensorflow`.
""", {
        "Inputs": ["bridgeflow.adapters.tensorflow.QueueInput", "bridgeflow.adapters.tensorflow.StagingInput",
                   "bridgeflow.adapters.tensorflow.to_tf_dataset", "bridgeflow.adapters.tensorflow.FeedInput",
                   "bridgeflow.adapters.tensorflow.DummyConstantInput"],
        "Signatures": ["bridgeflow.adapters.tensorflow.Signature",
                       "bridgeflow.adapters.tensorflow.infer_signature"],
        "The input interface": ["bridgeflow.adapters.tensorflow.InputSource",
                                "bridgeflow.adapters.tensorflow.InputSourceError"],
    }),
    "remote": ("Remote", """
Datapoints from other hosts over ZeroMQ (encrypted and authenticated with CurveZMQ keys), and a map stage on
Ray. How: :doc:`../remote`.
""", {
        "ZeroMQ streams": ["bridgeflow.RemoteDataZMQ", "bridgeflow.send_dataflow_zmq", "bridgeflow.remote.CurveKeys",
                           "bridgeflow.remote.generate_keys", "bridgeflow.remote.load_keys"],
        "Ray": ["bridgeflow.RayMapData"],
        "Errors": ["bridgeflow.RemoteConnectionError", "bridgeflow.ProducerError", "bridgeflow.ProducerLostError",
                   "bridgeflow.MessageTooLargeError"],
    }),
    "images": ("Images and datasets", """
Flows that read and augment images, and the ILSVRC12 and CIFAR datasets read from local copies. The augmentors
themselves: :doc:`imgaug`. How: :doc:`../images`.
""", {
        "Augmenting flows": ["bridgeflow.AugmentImageComponent", "bridgeflow.AugmentImageComponents",
                             "bridgeflow.AugmentImageCoordinates"],
        "Reading image files": ["bridgeflow.ImageFromFile"],
        "Datasets": ["bridgeflow.dataset.ILSVRC12", "bridgeflow.dataset.ILSVRC12Files",
                     "bridgeflow.dataset.ILSVRCMeta", "bridgeflow.dataset.Cifar10", "bridgeflow.dataset.Cifar100",
                     "bridgeflow.dataset.CifarBase", "bridgeflow.dataset.dataset_path",
                     "bridgeflow.dataset.DatasetFilesMissingError"],
        "Fake copies for tests": ["bridgeflow.dataset.write_fake_ilsvrc12", "bridgeflow.dataset.write_fake_cifar"],
    }),
    "imgaug": ("Image augmentors", """
``bridgeflow.imgaug``: tensorpack's augmentors with their names, arguments and random draws, on OpenCV and
numpy (imported when an augmentor first needs it). Apply them with :class:`~bridgeflow.AugmentImageComponent`.
""", {
        "Geometry": ["bridgeflow.imgaug.Flip", "bridgeflow.imgaug.Resize", "bridgeflow.imgaug.ResizeShortestEdge",
                     "bridgeflow.imgaug.RandomResize", "bridgeflow.imgaug.CenterCrop", "bridgeflow.imgaug.RandomCrop",
                     "bridgeflow.imgaug.GoogleNetRandomCropAndResize", "bridgeflow.imgaug.CenterPaste",
                     "bridgeflow.imgaug.Transpose", "bridgeflow.imgaug.BackgroundFiller",
                     "bridgeflow.imgaug.ConstantBackgroundFiller"],
        "Photometric": ["bridgeflow.imgaug.Brightness", "bridgeflow.imgaug.BrightnessScale",
                        "bridgeflow.imgaug.Contrast", "bridgeflow.imgaug.Saturation", "bridgeflow.imgaug.Lighting",
                        "bridgeflow.imgaug.Hue", "bridgeflow.imgaug.Gamma", "bridgeflow.imgaug.GaussianBlur",
                        "bridgeflow.imgaug.SaltPepperNoise",
                        "bridgeflow.imgaug.Clip", "bridgeflow.imgaug.ColorSpace", "bridgeflow.imgaug.Grayscale",
                        "bridgeflow.imgaug.ToUint8", "bridgeflow.imgaug.ToFloat32",
                        "bridgeflow.imgaug.MinMaxNormalize", "bridgeflow.imgaug.MeanVarianceNormalize"],
        "Combinators": ["bridgeflow.imgaug.AugmentorList", "bridgeflow.imgaug.RandomOrderAug",
                        "bridgeflow.imgaug.RandomApplyAug", "bridgeflow.imgaug.RandomChooseAug",
                        "bridgeflow.imgaug.MapImage", "bridgeflow.imgaug.Identity"],
        "Other libraries": ["bridgeflow.imgaug.Albumentations", "bridgeflow.imgaug.TorchvisionAugmentor",
                            "bridgeflow.imgaug.as_augmentor"],
        "Writing an augmentor": ["bridgeflow.imgaug.ImageAugmentor", "bridgeflow.imgaug.PhotometricAugmentor",
                                 "bridgeflow.imgaug.check_dtype"],
        "Transforms": ["bridgeflow.imgaug.Transform", "bridgeflow.imgaug.BaseTransform",
                       "bridgeflow.imgaug.TransformList", "bridgeflow.imgaug.TransformFactory",
                       "bridgeflow.imgaug.LazyTransform", "bridgeflow.imgaug.NoOpTransform",
                       "bridgeflow.imgaug.CropTransform", "bridgeflow.imgaug.FlipTransform",
                       "bridgeflow.imgaug.ResizeTransform", "bridgeflow.imgaug.TransposeTransform",
                       "bridgeflow.imgaug.PhotometricTransform"],
        "Interpolation codes": ["bridgeflow.imgaug.INTER_NEAREST", "bridgeflow.imgaug.INTER_LINEAR",
                                "bridgeflow.imgaug.INTER_CUBIC", "bridgeflow.imgaug.INTER_AREA",
                                "bridgeflow.imgaug.INTER_LANCZOS4"],
    }),
    "testing": ("Testing your flows", """
``bridgeflow.testing``: the contract checks bridgeflow's own flows pass, for the tests of yours.
""", {
        "Checks": ["bridgeflow.testing.check_dataflow", "bridgeflow.testing.check_resumable",
                   "bridgeflow.testing.assert_same_datapoints", "bridgeflow.testing.datapoint_structure"],
    }),
    "errors": ("Errors and warnings", """
Every error bridgeflow raises on purpose is a :class:`~bridgeflow.BridgeflowError` and, where one fits, also a built-in
type (a ``ValueError``, ``TypeError``, ``RuntimeError``...), so existing ``except`` clauses keep working. The
errors of one area are described on its page; the table at the end links them all.
""", {
        "Errors": ["bridgeflow.BridgeflowError", "bridgeflow.DatapointError", "bridgeflow.BatchError",
                   "bridgeflow.WorkerError", "bridgeflow.WorkerTimeoutError", "bridgeflow.DataFlowReentrantError",
                   "bridgeflow.DataFlowTerminated", "bridgeflow.LengthUnknownError",
                   "bridgeflow.MissingDependencyError"],
    }),
    "index": ("API reference", "", {
        "Version": ["bridgeflow.__version__"],
    }),
}
