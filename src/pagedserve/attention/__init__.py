"""Paged attention: metadata built once per step, and the torch kernels that use it."""
