#!/usr/bin/env python3
"""Make a tiny Hugging Face model, tokenizer and dataset to fine-tune with parcompile.

Everything comes from text every Python carries (the ``pydoc_data`` topics), nothing
from a hub:

- a byte-level BPE tokenizer trained on that text with the ``tokenizers`` library
  (``tokenizer.json``, and a ``tokenizer_config.json`` with its end-of-text token and a
  ChatML chat template, as transformers reads them);
- a random tiny model of a Hugging Face family (``--family llama``, ``qwen2`` or
  ``gpt2``) made with transformers' own class and written with ``save_pretrained``
  (``config.json`` + safetensors);
- ``train.jsonl`` / ``eval.jsonl`` (one ``{"text": ...}`` document per line),
  ``sft.jsonl`` (``prompt`` / ``completion``) and ``chat.jsonl`` (``messages``);
- ``finetune.par``: a spec that fine-tunes the model on them under dp 2 x tp 2 x pp 2 on
  this machine's CPU and writes the result as a Hugging Face checkpoint;
- ``serve.par``: a spec that serves that checkpoint (tp 2) for ``parcompile serve``.

Usage::

    python examples/make_tiny_hf.py build/tiny_hf      # then:
    parcompile run build/tiny_hf/finetune.par          # writes build/tiny_hf/finetuned/

Needs ``transformers``, ``tokenizers`` and ``safetensors`` (``pip install -e '.[test]'``).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

#: ChatML, as Qwen's tokenizers write it (a `{% generation %}`-free template)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def corpus() -> list[str]:
    """English paragraphs of Python's own documentation (``pydoc_data.topics``), in a fixed order."""
    from pydoc_data.topics import topics

    paragraphs = []
    for name in sorted(topics):
        for para in re.split(r"\n\s*\n", topics[name]):
            para = " ".join(para.split())
            if len(para) > 80:
                paragraphs.append(para)
    return paragraphs


def make_tokenizer(out: Path, vocab_size: int = 512, texts: list[str] | None = None) -> int:
    """Train a byte-level BPE tokenizer on ``texts`` (default: :func:`corpus`) and write
    ``tokenizer.json`` and ``tokenizer_config.json`` into ``out``; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts if texts is not None else corpus(), trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "chat_template": CHAT_TEMPLATE, "model_max_length": 2048,
    }, indent=2))
    return tok.get_vocab_size(with_added_tokens=True)


def make_model(out: Path, family: str, vocab: int, layers: int = 4, hidden: int = 64, heads: int = 4,
               kv_heads: int = 2, ffn: int = 128, max_positions: int = 256, seed: int = 0, dtype: str = "float32"):
    """A random transformers model of ``family`` (``llama``, ``qwen2``, ``gpt2``), written to
    ``out`` with ``save_pretrained`` (safetensors); returns the model."""
    import torch

    from parcompile.runtime.machine.device import quiet_deepspeed_on_cpu

    quiet_deepspeed_on_cpu()   # before transformers imports DeepSpeed: no "Setting accelerator to CPU" warning
    import transformers

    torch.manual_seed(seed)
    if family == "gpt2":   # LayerNorm, GELU, learned positions, biases, tied embeddings
        cfg = transformers.GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads,
                                      n_positions=max_positions, n_inner=ffn, activation_function="gelu_new",
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
                                      bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        kind = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[family]
        cfg = kind[0](vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                      rms_norm_eps=1e-6, tie_word_embeddings=(family == "qwen2"), eos_token_id=0)
        model = kind[1](cfg)
    with torch.no_grad():   # non-trivial norms, so a misplaced norm weight would show
        for name, p in model.named_parameters():
            if "norm" in name or name.split(".")[-2].startswith("ln_"):
                p.uniform_(0.5, 1.5) if name.endswith("weight") else p.uniform_(-0.1, 0.1)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(str(out), safe_serialization=True)
    return model


def write_data(out: Path, texts: list[str] | None = None) -> None:
    """``train.jsonl`` / ``eval.jsonl`` (text), ``sft.jsonl`` (prompt_completion) and
    ``chat.jsonl`` (chat) from :func:`corpus`: every 10th paragraph is held out for eval."""
    texts = texts if texts is not None else corpus()
    train = [t for i, t in enumerate(texts) if i % 10]
    held = [t for i, t in enumerate(texts) if i % 10 == 0]

    def dump(name, rows):
        with open(out / name, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")

    dump("train.jsonl", [{"text": t} for t in train])
    dump("eval.jsonl", [{"text": t} for t in held])
    pairs = []   # short prompts of unequal length, and what follows them
    for i, t in enumerate(train[:400]):
        words = t.split()
        a = 3 + i % 5
        pairs.append((" ".join(words[:a]), " " + " ".join(words[a:a + 8 + i % 13])))   # the space starts the completion
    dump("sft.jsonl", [{"prompt": "Explain: " + a, "completion": b} for a, b in pairs])
    dump("chat.jsonl", [{"messages": [{"role": "user", "content": a},
                                      {"role": "assistant", "content": b.strip()}]} for a, b in pairs])


#: The model and cluster blocks both specs share; ``{gpus}``: the processes they run on.
MODEL_AND_CLUSTER = """\
model tiny from "config.json" {{
    seq_len = 64
    dtype   = fp32
}}

cluster local from "cpu" {{
    nodes         = 1
    gpus_per_node = {gpus}
}}
"""

SPEC = """\
# Fine-tune the tiny {family} model in this directory on train.jsonl (made by
# examples/make_tiny_hf.py): dp 2 x tp 2 x pp 2 on 8 CPU processes. The tokenizer is the
# model directory's own (init_from's); the result is a Hugging Face checkpoint.
""" + MODEL_AND_CLUSTER + """
parallel {{
    dp = 2
    tp = 2
    pp = 2
    micro_batch  = 2
    global_batch = 16
}}

train {{
    init_from    = "."            # config.json + model.safetensors, read in this plan's layout
    data         = "train.jsonl"
    eval_data    = "eval.jsonl"
    eval_every   = 10
    eval_batches = 4
    optimizer    = adamw
    lr           = 1e-3
    steps        = 20
    log_every    = 5
    hf_output    = "finetuned"    # AutoModelForCausalLM.from_pretrained loads it
}}
"""

SERVE_SPEC = """\
# Serve the fine-tuned model (finetune.par's hf_output) behind an OpenAI-compatible API on
# 2 CPU processes (tp 2): `parcompile serve serve.par`; lm-eval reads its tokenizer from
# finetuned/ (README: "Evaluate a served Hugging Face checkpoint").
""" + MODEL_AND_CLUSTER + """
parallel {{
    tp = 2
}}

serve {{
    batch          = 8
    prompt_len     = 32
    max_new_tokens = 32
    weights        = "finetuned"      # written by `parcompile run finetune.par`
}}
"""


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="directory to write (model, tokenizer, data, finetune.par)")
    ap.add_argument("--family", choices=["llama", "qwen2", "gpt2"], default="llama")
    ap.add_argument("--vocab-size", type=int, default=512, help="BPE vocabulary to train")
    args = ap.parse_args(argv)
    texts = corpus()
    vocab = make_tokenizer(args.out, args.vocab_size, texts)
    make_model(args.out, args.family, vocab)
    write_data(args.out, texts)
    (args.out / "finetune.par").write_text(SPEC.format(family=args.family, gpus=8))
    (args.out / "serve.par").write_text(SERVE_SPEC.format(gpus=2))
    print(f"wrote {args.out}/: a {args.family} model (vocab {vocab}), tokenizer, train/eval/sft/chat jsonl, "
          f"finetune.par, serve.par\nnext: parcompile run {args.out}/finetune.par")


if __name__ == "__main__":
    main()
