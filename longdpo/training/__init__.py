"""The DPOTrainer subclass, its callbacks and the steps of a run."""
