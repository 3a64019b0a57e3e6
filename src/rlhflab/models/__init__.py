"""Models: load HF tokenizers / causal LMs / reward models, value heads, LoRA, and the tiny default.

Imports torch, transformers, peft, tokenizers, safetensors and `rlhflab.errors` only.
"""

from rlhflab.models.checkpointing import checkpointing_on, enable_gradient_checkpointing
from rlhflab.models.lean import lean_hidden, plan_lean, read_columns
from rlhflab.models.load import count_parameters, disable_dropout, load_causal_lm, load_tokenizer
from rlhflab.models.lora import adapter_values, adapters_off, add_value_adapter, apply_lora, merged_adapter
from rlhflab.models.lora import trainable_parameters, use_adapter
from rlhflab.models.reward import build_random_reward_model, build_reward_model, build_reward_model_from_causal
from rlhflab.models.reward import can_grow_saved_trunk, can_grow_trunk, freeze_lower_layers, grow_trunk
from rlhflab.models.reward import can_pack_pairs, is_encoder_reward_model, last_real_index, load_reward_model
from rlhflab.models.reward import grouped_scores, packed_pair_scores, sequence_scores, special_tokens_frame
from rlhflab.models.packing import PackedPairs, pack_shared_prefix, packed_length
from rlhflab.models.prompt_groups import PackedGroups, pack_groups
from rlhflab.models.packed_sequences import PackedSequences, can_pack_sequences, fill_rows, pack_rows, pack_sequences
from rlhflab.models.packed_sequences import packed_target_logits
from rlhflab.models.shared_prompt import distinct_prompts, shared_prompt_logits
from rlhflab.models.token_head import HeadInputs, configure_logits_chunks, head_inputs, output_layer
from rlhflab.models.token_head import token_logprobs
from rlhflab.models.token_head import token_logprobs_and_entropy
from rlhflab.models.tiny_model import TINY_ARCHITECTURES, TinySizes, build_tiny_model, save_model_folder
from rlhflab.models.tiny_tokenizer import EOS_TOKEN, PAD_TOKEN, build_tokenizer, template_words
from rlhflab.models.value import ValueHead, ValueModel, last_hidden_state

__all__ = [
    "EOS_TOKEN", "HeadInputs", "PAD_TOKEN", "PackedGroups", "PackedPairs", "PackedSequences", "TINY_ARCHITECTURES", "TinySizes", "ValueHead",
    "ValueModel",
    "adapter_values", "adapters_off", "add_value_adapter", "apply_lora", "build_random_reward_model",
    "build_reward_model", "build_reward_model_from_causal", "build_tiny_model", "build_tokenizer", "can_pack_pairs",
    "can_pack_sequences", "fill_rows", "pack_rows", "pack_sequences", "packed_target_logits",
    "can_grow_saved_trunk", "can_grow_trunk", "configure_logits_chunks", "checkpointing_on", "count_parameters", "disable_dropout", "distinct_prompts",
    "enable_gradient_checkpointing", "freeze_lower_layers", "grouped_scores", "grow_trunk", "head_inputs",
    "is_encoder_reward_model", "last_hidden_state", "lean_hidden",
    "last_real_index", "load_causal_lm", "load_reward_model", "merged_adapter", "output_layer", "pack_groups", "pack_shared_prefix", "packed_length",
    "packed_pair_scores", "load_tokenizer", "plan_lean", "read_columns", "save_model_folder", "sequence_scores", "shared_prompt_logits",
    "special_tokens_frame", "template_words", "token_logprobs", "token_logprobs_and_entropy", "trainable_parameters", "use_adapter",
]
