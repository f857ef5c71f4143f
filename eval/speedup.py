"""`python -m eval.speedup [hydra overrides]`: see configs/eval_speedup.yaml (code: dflash2.eval.speedup)."""

from dflash2.eval.speedup_cli import main

if __name__ == "__main__":
    main()
