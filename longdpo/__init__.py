"""Long-context DPO: TRL's DPOTrainer on DeepSpeed ZeRO-3 with memory levers, a planner, and runs that survive the
cluster. The layout shows the architecture:

    config.py, checks.py   the recipe schema and every start-up check
    data.py                preference pairs: files, Hub datasets, mixtures, synthetic workloads
    model/                 building the model and the memory levers that wrap its modules
    training/              the DPOTrainer subclass, its callbacks and the run's steps
    planner/               will it fit: the memory model, its calibration, the benchmark's configurations
    cluster/               distributed start-up and resilience (signals, complete checkpoints, disk)
    patches.py             every patch to a library we depend on
"""
