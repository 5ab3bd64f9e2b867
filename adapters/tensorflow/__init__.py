"""TensorFlow adapter: QueueInput, StagingInput, tf.data and Keras inputs from any DataFlow."""
