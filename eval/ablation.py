"""`python -m eval.ablation [options] [train overrides]`: the v1 vs DFlash2 ablation (code: dflash2.eval.ablation)."""

from dflash2.eval.ablation import main

if __name__ == "__main__":
    main()
