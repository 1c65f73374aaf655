"""blockzoo-huggingface: Hugging Face checkpoints as blockzoo formats (`blockzoo.load`, `blockzoo.save(...,
format=...)`, `blockzoo convert`). See docs/huggingface.md."""
