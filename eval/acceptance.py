"""`python -m eval.acceptance [hydra overrides]`: see configs/eval_acceptance.yaml (code: dflash2.eval)."""

from dflash2.eval.acceptance_cli import main

if __name__ == "__main__":
    main()
