"""Models built from the tensor-parallel layers."""
