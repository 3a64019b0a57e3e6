"""Load, validate, tokenise and collate user data.

    examples = load_examples("train.jsonl", "sft", tokenizer=tok, max_prompt_tokens=512)
    items = tokenize_sft(examples, tok, max_length=1024)
    batch = collate_sft(items, pad_id=tok.pad_token_id)   # SFTBatch
"""

from rlhflab.data.collate import IGNORE_INDEX, SFTBatch, collate_sft, left_pad, position_ids_from_mask
from rlhflab.data.load import load_examples, read_records
from rlhflab.data.records import Example, PairExample, PromptExample, Record, RowProblem, SFTExample
from rlhflab.data.tokenize import TokenizedSFT, encode_completions, encode_prompts, tokenize_sft
from rlhflab.data.validate import KINDS, validate

__all__ = [
    "IGNORE_INDEX",
    "KINDS",
    "Example",
    "PairExample",
    "PromptExample",
    "Record",
    "RowProblem",
    "SFTBatch",
    "SFTExample",
    "TokenizedSFT",
    "collate_sft",
    "encode_completions",
    "encode_prompts",
    "left_pad",
    "load_examples",
    "position_ids_from_mask",
    "read_records",
    "tokenize_sft",
    "validate",
]
