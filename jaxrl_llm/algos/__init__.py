"""Learning algorithms: GRPO (`grpo`), SFT (`sft`) and their optimizers (`optim`)."""
