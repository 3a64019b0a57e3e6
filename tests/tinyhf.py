"""Tiny Hugging Face models built in-process for tests (no downloads)."""

import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config

VOCAB = 40
PAD, EOS = 0, 1

CONFIGS = {
    "llama": lambda: LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 pad_token_id=PAD, eos_token_id=EOS),
    "gpt2": lambda: GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=PAD, eos_token_id=EOS),
    "qwen2": lambda: Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 pad_token_id=PAD, eos_token_id=EOS),
}


def build(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[arch]())
    return model.eval()



def save_suite_model(folder, arch: str = "llama") -> str:
    """A 2-layer model (Llama unless asked) with the built-in suite's tokenizer, saved as an HF folder (trainer tests
    start from it)."""
    from rlhflab import models, tasks

    tokenizer = models.build_tokenizer(tasks.template_corpus(), vocab_size=256)
    model = models.build_tiny_model(tokenizer, arch=arch, hidden_size=32, num_layers=2, num_heads=4,
                                    intermediate_size=64, seed=0)
    models.save_model_folder(folder, model, tokenizer)
    return str(folder)


def save_eos_prone_model(policy_dir, folder) -> str:
    """The tiny policy with its EOS row turned towards the mean final hidden state over the suite's prompts: at a
    response_length of 6 some answers end with EOS and some are cut (the plain tiny model's almost never end: EOS
    is 1 token in 256), so responses of several lengths reach what divides by token counts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhflab import tasks

    model, tokenizer = AutoModelForCausalLM.from_pretrained(policy_dir), AutoTokenizer.from_pretrained(policy_dir)
    prompts = [item.prompt for item in tasks.build_splits(0, 22, 11, 11)["train"]]
    with torch.no_grad():
        hidden = torch.cat([model.model(input_ids=torch.tensor([tokenizer(p)["input_ids"]])).last_hidden_state[0]
                            for p in prompts])
        mean = hidden.mean(dim=0)
        model.lm_head.weight[tokenizer.eos_token_id] = 2.0 * mean / mean.norm()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)
