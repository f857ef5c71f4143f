"""Training side of dflash2: the only package (with train.py) that imports Lightning and Hydra."""
