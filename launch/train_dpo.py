"""DPO training entrypoint (longdpo/train.py says how to call it and what its exit statuses mean).

python launch/train_dpo.py --recipe recipes/tiny_mistral/dpo_quickstart.yaml
deepspeed --num_gpus 8 launch/train_dpo.py ds_configs/zero3.json --recipe recipes/nemotron12b/dpo_12k.yaml
accelerate launch --config_file launch/accelerate/zero3.yaml launch/train_dpo.py --recipe <yaml>
"""

from longdpo.train import exit_now, main

if __name__ == "__main__":
    exit_now(main())
