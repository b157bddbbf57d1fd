"""Fused kernels for the hot paths, each beside a pure-JAX reference that referees it."""
