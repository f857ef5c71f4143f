"""Main entry point: `python train.py [hydra overrides]`.

With no arguments: build (or reuse) the embedded tiny target, regenerate
training data with it, train a DFlash2 drafter on CPU and save it under the
run's output folder. See README.md and configs/train.yaml.
"""

from dflash2.training.cli import main

if __name__ == "__main__":
    main()
