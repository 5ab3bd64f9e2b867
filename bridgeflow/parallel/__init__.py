"""Parallel stages: threads and processes with a shared-memory transport (see bridgeflow.parallel.*)."""
