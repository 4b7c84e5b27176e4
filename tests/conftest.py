import json
import socket
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from model import ModelArgs, Transformer  # noqa: E402

DATA = ROOT / "tests" / "data"


def tiny_args(**overrides) -> ModelArgs:
    config = dict(block_size=512, vocab_size=96, n_layer=2, n_head=4, n_local_heads=2, dim=64,
                  intermediate_size=160, rope_base=10000.0)
    return ModelArgs(**{**config, **overrides})


def free_port() -> int:
    """A TCP port nobody listens on now, for a torchrun rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_tiny_model(seed=0, **overrides) -> Transformer:
    """A random-weight LLaMA small enough to run anything in milliseconds. Weights are scaled up so the
    logits are peaked: random models with flat logits make greedy decoding hinge on rounding noise."""
    torch.manual_seed(seed)
    model = Transformer(tiny_args(**overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif "tok_embeddings" in name or name == "output.weight":
                p.normal_(0, 1.0)
            else:
                p.normal_(0, 1.5 / p.shape[-1] ** 0.5)
    return model.eval()


def save_checkpoint(model, path):
    """A checkpoint directory (config.json + model.safetensors) holding a tiny model's float weights."""
    from safetensors.torch import save_file
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if not (model.config.tie_embeddings and k == "output.weight")}
    save_file(state, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({**model.config.to_dict(), "stop_token_ids": []}))
    return path


@pytest.fixture
def tiny_model():
    return make_tiny_model()


@pytest.fixture(scope="session")
def default_checkpoint():
    from generate import default_checkpoint
    return default_checkpoint()


@pytest.fixture(scope="session")
def real_model(default_checkpoint):
    """The default SmolLM2-135M-Instruct in fp32 (converted from the shipped GGUF on first use)."""
    from generate import load_model
    return load_model(default_checkpoint, "cpu", torch.float32)


@pytest.fixture(scope="session")
def real_tokenizer(default_checkpoint):
    from tokenizer import get_tokenizer
    return get_tokenizer(default_checkpoint)


@pytest.fixture(scope="session")
def hf_reference():
    """Numbers computed once with Hugging Face transformers on the same GGUF (scripts/make_reference.py)."""
    return json.loads((DATA / "smollm2_reference.json").read_text())
