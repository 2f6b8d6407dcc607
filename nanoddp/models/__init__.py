"""Models that know nothing of parallelism: a small GPT, an MLP classifier, and SmolLM2-135M."""

from nanoddp.models.gpt import GPT, GPTConfig, MLPClassifier, count_parameters, gpt_config
from nanoddp.models.smollm2 import HFCausalLM, load_smollm2, load_smollm2_tokenizer, smollm2_missing

__all__ = [
    "GPT",
    "GPTConfig",
    "HFCausalLM",
    "MLPClassifier",
    "count_parameters",
    "gpt_config",
    "load_smollm2",
    "load_smollm2_tokenizer",
    "smollm2_missing",
]
