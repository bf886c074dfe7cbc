"""Build a tiny, randomly initialised Llama and a locally trained tokenizer (no model hub needed).

Run with the real-engine venv's python (it needs ``torch``, ``transformers`` and ``tokenizers``):

    $VENV/bin/python tests/real_engine/build_tiny_model.py OUT_DIR [--hidden 256 --layers 4]

Deterministic: a fixed corpus, a fixed seed, so two builds give the same weights and vocabulary.
The result is a directory vLLM serves directly (``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json`` with a chat template).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SPECIAL = ["<s>", "</s>", "<unk>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_WORD_TEXT = (
    "the a of to and in is it that for on with as was at by be this from or have an they which one you "
    "were her all she there would their we him been has when who will more no if out so said what up its "
    "about into than them can only other new some could time these two may then do first any my now such "
    "like our over man me even most made after also did many before must through back years where much "
    "your way well down should because each just those people how too little state good very make world "
    "still own see men work long get here between both life being under never day same another know while "
    "last might us great old year off come since against go came right used take three request token "
    "model batch router engine cache latency throughput memory decode prefill queue server cluster"
)
WORDS = _WORD_TEXT.split()


def corpus(seed: int, lines: int = 4000) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        n = rng.randint(5, 30)
        words = [rng.choice(WORDS) for _ in range(n)]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 99999)))
        out.append(" ".join(words) + rng.choice([".", "?", "!", ","]))
    return out


def build_tokenizer(out: Path, seed: int, vocab_size: int) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # type: ignore[import-not-found]

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"})
    )
    return int(tok.get_vocab_size())


def build_model(out: Path, seed: int, vocab: int, hidden: int, layers: int, max_len: int) -> int:
    import torch  # type: ignore[import-not-found]
    from transformers import LlamaConfig, LlamaForCausalLM  # type: ignore[import-not-found]

    torch.manual_seed(seed)
    heads = max(1, hidden // 32)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=32,
        max_position_embeddings=max_len,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=3,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(out))
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--max-len", type=int, default=4096)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(args.out, args.seed, args.vocab)
    params = build_model(args.out, args.seed, vocab, args.hidden, args.layers, args.max_len)
    print(json.dumps({"out": str(args.out), "vocab": vocab, "parameters": params}))


if __name__ == "__main__":
    main()
