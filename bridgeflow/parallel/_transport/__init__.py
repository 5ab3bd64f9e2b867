"""The machinery under the parallel stages, for contributors: how work and results cross between a
consumer and its workers. Nothing here is a DataFlow; the stages in :mod:`bridgeflow.parallel` use it.

- ``pool``: :class:`~bridgeflow.parallel.WorkerPool`, tasks out and results back in order, over
- ``channels``: one channel per pool, threads or processes, over
- ``worker``: the loop each worker runs, and what it knows of itself (``WorkerContext``);
- ``shm``, ``segments``, ``mapping``: the shared-memory slabs array bytes travel in, and who maps them;
- ``wire``, ``pickling``, ``forking``: the control words, the pickling of results and tasks, fork safety;
- ``forensics``: a stuck or dead worker's state and stack, for the error that names it;
- ``background``: the one background-thread primitive (a producer thread with a bounded queue).
"""
