"""The Hugging Face formats of Mamba 2 and its hybrids: mamba2 (Mamba2ForCausalLM), bamba, nemotron_h. Torch-free."""

from __future__ import annotations

MAMBA2_FORMATS = ()
