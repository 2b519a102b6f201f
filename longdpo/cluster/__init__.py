"""Distributed start-up on GPUs and CPUs, and what keeps a long run alive: signals, complete checkpoints, disk."""
