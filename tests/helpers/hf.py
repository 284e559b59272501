"""What Hugging Face's own implementation of a config.json says of it: the parameter count the
model specs (tuner.model_from_hf_config, the exports' trained models) are held to."""

from __future__ import annotations

import torch

from tuner._hf import text_config


def hf_param_count(config: dict) -> int:
    """Parameters of transformers' own implementation of ``config``, built on the meta device."""
    import transformers

    cfg = transformers.AutoConfig.for_model(**text_config(config))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())  # a tied head is one tensor, counted once
