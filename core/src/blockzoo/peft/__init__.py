"""Parameter-efficient fine-tuning: `model.peft` wraps the linears whose `apply_peft` resolves true (see `apply`)."""
