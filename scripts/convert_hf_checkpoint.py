"""Convert a Hugging Face LLaMA-family model directory into this project's checkpoint layout.

    python scripts/convert_hf_checkpoint.py --hf_dir path/to/hf_model --out checkpoints/MyModel

Reads safetensors or PyTorch .bin weights, sharded (with an index file) or not. Q and K are permuted from
HF's rotate-half RoPE layout into the interleaved-pair layout model.py uses; q, k, v are fused into wqkv.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from model import ModelArgs, args_from_hf_config, permute_rotate_half, rope_from_hf_config  # noqa: E402,F401
from tokenizer import CHAT_TEMPLATES, chat_template_name, default_system_prompt, read_chat_template  # noqa: E402


def check_out_dir(out_dir, source=None):
    """A conversion replaces out_dir as a whole: refuse one that is not empty and not a checkpoint of this
    project's (a folder of several, a model's own directory), or that is the model being converted."""
    out_dir = Path(out_dir)
    if source is not None and out_dir.resolve() == Path(source).resolve():
        raise ValueError(f"--out {out_dir} is the model being converted: write the checkpoint elsewhere")
    if out_dir.is_file() or (out_dir.is_dir() and any(out_dir.iterdir()) and not (
            (out_dir / "model.safetensors").is_file() and "n_layer" in read_json(out_dir / "config.json"))):
        raise ValueError(f"--out {out_dir} exists and is not a checkpoint this project wrote: it would be replaced "
                         "as a whole, so give a new or empty directory")


def read_json(path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


def write_checkpoint(out_dir, weights: dict, args: ModelArgs, extra_config: dict, tokenizer_files=(),
                     tokenizer_json=None):
    """Writes model.safetensors, config.json and the tokenizer into out_dir atomically (a temporary
    directory renamed into place), so an interrupted conversion never leaves a half checkpoint."""
    from safetensors.torch import save_file
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp"))
    try:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps({**args.to_dict(), **extra_config}, indent=2) + "\n")
        for f in tokenizer_files:
            shutil.copy(f, tmp / Path(f).name)
        if tokenizer_json is not None:
            (tmp / "tokenizer.json").write_text(tokenizer_json)
        if out_dir.exists():
            check_out_dir(out_dir)
            shutil.rmtree(out_dir)
        tmp.chmod(0o755)
        os.rename(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def load_hf_weights(hf_dir: Path) -> dict:
    from safetensors.torch import load_file
    for index_name, single in (("model.safetensors.index.json", "model.safetensors"),
                               ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        if (hf_dir / index_name).is_file():
            files = sorted(set(json.loads((hf_dir / index_name).read_text())["weight_map"].values()))
            break
        if (hf_dir / single).is_file():
            files = [single]
            break
    else:
        raise FileNotFoundError(f"no model.safetensors or pytorch_model.bin (or their index) in {hf_dir}")
    weights = {}
    for f in files:
        path = hf_dir / f
        weights.update(load_file(str(path)) if f.endswith(".safetensors")
                       else torch.load(path, map_location="cpu", weights_only=True))
    return weights


def convert_hf_state_dict(hf: dict, args: ModelArgs) -> dict:
    hd = args.head_dim
    hf = {k.removeprefix("model."): v for k, v in hf.items()}  # some exports drop the "model." prefix
    if args.tie_embeddings:
        hf.pop("lm_head.weight", None)  # some exports save the tied embedding twice

    def get(k):
        if k not in hf:
            raise ValueError(f"weight {k!r} missing from the checkpoint")
        return hf.pop(k)

    out = {"tok_embeddings.weight": get("embed_tokens.weight"), "norm.weight": get("norm.weight")}
    if not args.tie_embeddings:
        out["output.weight"] = get("lm_head.weight")
    for i in range(args.n_layer):
        p = f"layers.{i}."
        q = permute_rotate_half(get(p + "self_attn.q_proj.weight"), args.n_head, hd)
        k = permute_rotate_half(get(p + "self_attn.k_proj.weight"), args.n_local_heads, hd)
        out[p + "attention.wqkv.weight"] = torch.cat([q, k, get(p + "self_attn.v_proj.weight")])
        out[p + "attention.wo.weight"] = get(p + "self_attn.o_proj.weight")
        out[p + "feed_forward.w1.weight"] = get(p + "mlp.gate_proj.weight")
        out[p + "feed_forward.w3.weight"] = get(p + "mlp.up_proj.weight")
        out[p + "feed_forward.w2.weight"] = get(p + "mlp.down_proj.weight")
        out[p + "attention_norm.weight"] = get(p + "input_layernorm.weight")
        out[p + "ffn_norm.weight"] = get(p + "post_attention_layernorm.weight")
    # what is left would be silently dropped: biases (Qwen2), extra layers, other architectures
    left = [k for k in hf if not k.endswith("rotary_emb.inv_freq")]
    if left:
        raise ValueError(f"unexpected weights {sorted(left)[:4]}: not a LLaMA-architecture checkpoint?")
    return out


def stop_ids_from_hf(hf_dir: Path, config: dict) -> list:
    ids = config.get("eos_token_id")
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    gen = hf_dir / "generation_config.json"
    if gen.is_file():
        g = json.loads(gen.read_text()).get("eos_token_id")
        ids |= set(g if isinstance(g, list) else [g] if g is not None else [])
    tok_json = hf_dir / "tokenizer.json"
    if tok_json.is_file():  # end-of-turn markers of the chat formats
        added = {t["content"]: t["id"] for t in json.loads(tok_json.read_text()).get("added_tokens", [])}
        ids |= {added[t] for t in ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>") if t in added}
    return sorted(ids)


def convert_hf_checkpoint(hf_dir, out_dir, chat_template=None):
    hf_dir = Path(hf_dir)
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"{hf_dir} has no config.json: not a Hugging Face model directory")
    check_out_dir(out_dir, hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    try:
        args = args_from_hf_config(config)
    except KeyError as e:
        raise ValueError(f"{hf_dir / 'config.json'} lacks {e}") from None
    weights = convert_hf_state_dict(load_hf_weights(hf_dir), args)
    tokenizer_files = [hf_dir / f for f in ("tokenizer.json", "tokenizer.model") if (hf_dir / f).is_file()]
    jinja = read_chat_template(hf_dir / "tokenizer_config.json")
    extra = {"chat_template": chat_template or chat_template_name(jinja),
             "default_system_prompt": default_system_prompt(jinja),
             "stop_token_ids": stop_ids_from_hf(hf_dir, config), "source": str(hf_dir)}
    return write_checkpoint(out_dir, weights, args, extra, tokenizer_files)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf_dir", required=True, help="Hugging Face model directory (config.json + weights)")
    p.add_argument("--out", required=True, help="output checkpoint directory")
    p.add_argument("--chat_template", default=None, choices=CHAT_TEMPLATES, help="override the guessed chat format")
    a = p.parse_args(argv)
    try:
        out = convert_hf_checkpoint(a.hf_dir, a.out, a.chat_template)
    except (FileNotFoundError, KeyError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
