"""The gradient noise scale on the byte-level LM of ``examples/char_lm``, and AdaptiveBatchSize against fixed k."""
