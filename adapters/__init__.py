"""Framework adapters, installed as ``bridgeflow.adapters``: ``bridgeflow.adapters.torch`` and
``bridgeflow.adapters.tensorflow``. Each imports its framework only when imported itself."""
