"""`gpudiag profile`: the same evidence and rules for an unmodified training script."""
