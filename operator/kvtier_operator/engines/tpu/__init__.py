"""vLLM on Google TPUs (tpu-inference): the adapter and its sizing."""
