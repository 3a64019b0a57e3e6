"""Models: load HF tokenizers / causal LMs, and build the tiny default model and tokenizer.

Imports torch, transformers, peft, tokenizers, safetensors and `rlhflab.errors` only.
"""

from rlhflab.models.load import count_parameters, disable_dropout, load_causal_lm, load_tokenizer
from rlhflab.models.tiny_model import TINY_ARCHITECTURES, TinySizes, build_tiny_model, save_model_folder
from rlhflab.models.tiny_tokenizer import EOS_TOKEN, PAD_TOKEN, build_tokenizer, template_words

__all__ = [
    "EOS_TOKEN",
    "PAD_TOKEN",
    "TINY_ARCHITECTURES",
    "TinySizes",
    "build_tiny_model",
    "build_tokenizer",
    "count_parameters",
    "disable_dropout",
    "load_causal_lm",
    "load_tokenizer",
    "save_model_folder",
    "template_words",
]
