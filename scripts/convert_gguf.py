"""Convert a GGUF file (llama architecture) into this project's checkpoint layout.

    python scripts/convert_gguf.py --gguf model.gguf --out checkpoints/MyModel

Quantized tensors are dequantized to float32 with the `gguf` package. GGUF already stores Q and K in the
interleaved-pair RoPE layout model.py uses, so unlike the HF conversion nothing is permuted. The byte-level
BPE tokenizer is rebuilt from the GGUF metadata into a tokenizer.json.
"""
import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from model import ModelArgs, apply_rope_scaling  # noqa: E402
from scripts.convert_hf_checkpoint import check_out_dir, write_checkpoint  # noqa: E402
from tokenizer import chat_template_name, default_system_prompt  # noqa: E402

GGUF_TO_OURS = {"attn_output": "attention.wo", "ffn_gate": "feed_forward.w1", "ffn_up": "feed_forward.w3",
                "ffn_down": "feed_forward.w2", "attn_norm": "attention_norm", "ffn_norm": "ffn_norm"}

# the pre-tokenizer split pattern of Llama-3's tokenizer.json (llama.cpp calls it "llama-bpe")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")


def field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_tensor(t) -> torch.Tensor:
    import gguf
    w = gguf.quants.dequantize(t.data, t.tensor_type)  # numpy, shape in row-major (out, in) order
    return torch.from_numpy(np.array(w, dtype=np.float32))  # a copy: GGUF data is a read-only memmap


def args_from_gguf(reader) -> ModelArgs:
    arch = field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture is {arch!r}; only 'llama' is supported")
    g = lambda k, d=None: field(reader, f"llama.{k}", d)  # noqa: E731
    scaling_type = g("rope.scaling.type", "none")
    if scaling_type != "none":  # linear, yarn: model.py implements only Llama-3's scaling
        raise ValueError(f"unsupported GGUF rope scaling type {scaling_type!r}")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF has no token_embd.weight tensor")
    n_head = g("attention.head_count")
    args = ModelArgs(block_size=g("context_length", 4096), vocab_size=int(tensors["token_embd.weight"].shape[1]),
                     n_layer=g("block_count"), n_head=n_head, dim=g("embedding_length"),
                     intermediate_size=g("feed_forward_length"), n_local_heads=g("attention.head_count_kv", n_head),
                     head_dim=g("rope.dimension_count") or g("embedding_length") // n_head,
                     rope_base=float(g("rope.freq_base", 10000.0)),
                     norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
                     tie_embeddings="output.weight" not in tensors)
    if "rope_freqs.weight" in tensors:
        args.rope_scaling = rope_scaling_from_factors(read_tensor(tensors["rope_freqs.weight"]), args)
    return args


def rope_scaling_from_factors(factors: torch.Tensor, args: ModelArgs):
    """Llama-3.1/3.2 GGUFs keep their RoPE scaling only as per-frequency divisors (rope_freqs.weight).
    Meta's models all use low/high_freq_factor 1 and 4 and an 8192 original context and vary only the
    factor: solve for it at the lowest frequency (the most slowed one), then check every divisor."""
    hd, factors = args.head_dim, factors.double().flatten()
    freqs = 1.0 / (args.rope_base ** (torch.arange(0, hd, 2).double() / hd))
    if factors.numel() != freqs.numel():
        raise ValueError(f"rope_freqs.weight has {factors.numel()} values, expected head_dim/2 = {freqs.numel()}")
    if torch.allclose(factors, torch.ones_like(factors)):
        return None
    old_context, low, high = 8192, 1.0, 4.0
    smooth = ((old_context * freqs[-1] / (2 * torch.pi) - low) / (high - low)).clamp(0, 1)  # 0: fully slowed
    factor = (1 - smooth) / (1 / factors[-1] - smooth)
    scaling = dict(factor=round(float(factor), 4),  # the divisors are float32: make 8.00001 read 8.0
                   low_freq_factor=low, high_freq_factor=high, original_max_position_embeddings=old_context)
    if not torch.allclose(freqs / apply_rope_scaling(freqs, scaling), factors, rtol=1e-4):
        raise ValueError("rope_freqs.weight is not Llama-3 rope scaling with low/high_freq_factor 1/4 and "
                         "an 8192 original context; unsupported")
    return scaling


def gguf_weights(reader, args: ModelArgs) -> dict:
    raw = {t.name: read_tensor(t) for t in reader.tensors}
    out = {"tok_embeddings.weight": raw.pop("token_embd.weight"), "norm.weight": raw.pop("output_norm.weight")}
    if "output.weight" in raw:
        out["output.weight"] = raw.pop("output.weight")
    for i in range(args.n_layer):
        p = f"blk.{i}."
        out[f"layers.{i}.attention.wqkv.weight"] = torch.cat([raw.pop(p + n) for n in
                                                             ("attn_q.weight", "attn_k.weight", "attn_v.weight")])
        for theirs, ours in GGUF_TO_OURS.items():
            out[f"layers.{i}.{ours}.weight"] = raw.pop(f"{p}{theirs}.weight")
    raw.pop("rope_freqs.weight", None)  # Llama-3.1 GGUFs store the scaled frequencies; not needed here
    if raw:
        raise ValueError(f"unexpected tensors in GGUF: {sorted(raw)[:5]}")
    return out


def gguf_tokenizer_json(reader) -> str:
    """A byte-level BPE tokenizer.json from the GGUF's token list, merges and token types."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    if field(reader, "tokenizer.ggml.model") != "gpt2":
        raise ValueError("only byte-level BPE ('gpt2') GGUF tokenizers are supported; "
                         "for SentencePiece models convert the Hugging Face checkpoint instead")
    tokens = field(reader, "tokenizer.ggml.tokens")
    types = field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    pre_type = field(reader, "tokenizer.ggml.pre")
    if pre_type == "llama-bpe":  # Llama-3 splits text with its own pattern (numbers in groups of 3, ...)
        pre = [pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
               pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    else:  # GPT-2's pattern
        pre = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if pre_type in ("smollm", "starcoder", "refact"):
        pre.insert(0, pre_tokenizers.Digits(individual_digits=True))  # these split numbers digit by digit
    tok.pre_tokenizer = pre_tokenizers.Sequence(pre)
    tok.decoder = decoders.ByteLevel()
    # control tokens (type 3) and user-defined ones (type 4) are matched whole in text, never split
    tok.add_special_tokens([t for t, ty in zip(tokens, types) if ty in (3, 4)])
    return tok.to_str()


def chat_info_from_gguf(reader):
    """The chat format and its default system prompt, read from the GGUF's Jinja chat template."""
    template = field(reader, "tokenizer.chat_template", "") or ""
    return chat_template_name(template), default_system_prompt(template)


def convert_gguf(gguf_path, out_dir):
    import gguf
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    check_out_dir(out_dir)
    reader = gguf.GGUFReader(str(gguf_path))
    args = args_from_gguf(reader)
    weights = gguf_weights(reader, args)
    tokens = field(reader, "tokenizer.ggml.tokens")
    stop = {field(reader, "tokenizer.ggml.eos_token_id")}
    stop |= {i for i, t in enumerate(tokens) if t in ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>")}
    template, system = chat_info_from_gguf(reader)
    extra = {"chat_template": template, "default_system_prompt": system,
             "stop_token_ids": sorted(i for i in stop if i is not None), "source": gguf_path.name}
    return write_checkpoint(out_dir, weights, args, extra, tokenizer_json=gguf_tokenizer_json(reader))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", required=True, help="path to a .gguf file")
    p.add_argument("--out", required=True, help="output checkpoint directory")
    a = p.parse_args(argv)
    try:
        out = convert_gguf(a.gguf, a.out)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
