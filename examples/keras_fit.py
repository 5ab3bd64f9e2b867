"""Train a small Keras model from a bridgeflow DataFlow, two ways (runs in about ten seconds on a CPU).

1. ``model.fit`` on ``to_tf_dataset(df)``.
2. A custom ``tf.function`` training step fed by ``QueueInput`` + ``StagingInput``, with the queue's
   average fill (near empty: the input is the bottleneck; near full: the model is).

Run:  python examples/keras_fit.py
"""

from __future__ import annotations

import logging
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

from bridgeflow import BatchData, FakeData, MapData
from bridgeflow.adapters.tensorflow import QueueInput, StagingInput, to_tf_dataset

DIM = 16


def make_flow(size: int, seed: int) -> BatchData:
    """Synthetic task: is the sum of 16 uniform numbers above its mean (8)?"""
    points = FakeData([[DIM]], size=size, dtype="float32", seed=seed)
    labelled = MapData(points, lambda dp: (dp[0], np.float32(dp[0].sum() > DIM / 2)))
    return BatchData(labelled, 64, remainder=True)


def make_model() -> tf.keras.Model:
    model = tf.keras.Sequential([
        tf.keras.Input((DIM,)),
        tf.keras.layers.Dense(32, activation="relu"),
        tf.keras.layers.Dense(1, activation="sigmoid"),
    ])
    model.compile(optimizer=tf.keras.optimizers.Adam(0.01), loss="binary_crossentropy", metrics=["accuracy"])
    return model


def fit_on_dataset() -> None:
    model = make_model()
    with make_flow(4096, seed=0) as train, make_flow(1024, seed=1) as val:
        hist = model.fit(to_tf_dataset(train, dynamic_batch=True), epochs=5, shuffle=False, verbose=0,
                         validation_data=to_tf_dataset(val, dynamic_batch=True))
    for epoch, (loss, acc) in enumerate(zip(hist.history["loss"], hist.history["val_accuracy"]), 1):
        print(f"[fit] epoch {epoch}: train loss {loss:.3f}, validation accuracy {acc:.3f}")


def custom_loop_with_queue() -> None:
    model = make_model()
    optimizer = tf.keras.optimizers.Adam(0.01)
    loss_fn = tf.keras.losses.BinaryCrossentropy()
    inputs = StagingInput(QueueInput(make_flow(4096, seed=2), queue_size=16, epochs=3, dynamic_batch=True))

    @tf.function
    def step():
        x, y = inputs.dequeue()
        with tf.GradientTape() as tape:
            loss = loss_fn(y[:, None], model(x, training=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                      model.trainable_variables))
        return loss

    losses = []
    with inputs:
        steps = inputs.run_until_end(step, callback=lambda loss: losses.append(float(loss)))
        stats = inputs.stats()
    print(f"[queue] {steps} steps over 3 epochs; loss {np.mean(losses[:10]):.3f} -> {np.mean(losses[-10:]):.3f}; "
          f"average queue fill {stats['queue_fill_avg']:.1f}/{stats['queue_capacity']:.0f}")


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    fit_on_dataset()
    custom_loop_with_queue()
