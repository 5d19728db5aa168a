"""The ``lightning-accum`` command line."""
