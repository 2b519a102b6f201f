"""Will it fit? Per-rank memory plan of a recipe before launch (longdpo/planner/cli.py says how to call it).

python launch/plan_memory.py --recipe recipes/nemotron12b/dpo_12k.yaml --gpus 8 --gpu-memory 80GB
"""

import sys

from longdpo.planner.cli import main

if __name__ == "__main__":
    sys.exit(main())
