"""Serialization of DataFlows to LMDB, HDF5 and npz files, with a safe codec."""
