"""PyTorch adapter: a drop-in DataLoader on bridgeflow workers and a CUDA-stream prefetcher."""
