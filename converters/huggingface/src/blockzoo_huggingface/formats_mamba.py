"""The Hugging Face formats of Mamba 1 and its hybrids: mamba (MambaForCausalLM), jamba,
apriel_hybrid_ssm. Torch-free."""

from __future__ import annotations

MAMBA_FORMATS = ()
