"""A trial's memory: each rank's timeline over one measured step and the memory model's parts beside it."""
