"""Will it fit: the per-rank memory model, its calibration and the benchmark's named configurations."""
