"""launch/train_dpo.py with every training step under identity saved-tensor hooks (TRL's NoOpManager).

Activation offloading installs saved-tensor hooks around each training step, but TRL's offloader needs a GPU. The
identity hooks put the same thing in the way on CPU: every saved tensor comes back through the hooks as a new plain
tensor, which under ZeRO-3 crashed TRL's fused LM head at the first backward ('Tensor' object has no attribute
'ds_status'). Launched like train_dpo.py, with the same arguments.
"""

import os
import runpy

from trl import DPOTrainer
from trl.models.activation_offloading import NoOpManager

_training_step = DPOTrainer.training_step


def training_step_under_hooks(self, *args, **kwargs):
    with NoOpManager():
        return _training_step(self, *args, **kwargs)


DPOTrainer.training_step = training_step_under_hooks
runpy.run_path(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "launch", "train_dpo.py"),
    run_name="__main__",
)
