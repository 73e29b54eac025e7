"""Tensor parallelism over torch.distributed: ``parallel_state`` (the group and how weights
split; the model imports it) and ``executor`` (worker processes and the step loop)."""
