"""Experiments. Each takes plain parameters (the notebooks' and the CLI's names), validates them before
allocating anything, and writes tidy records into a run folder."""
