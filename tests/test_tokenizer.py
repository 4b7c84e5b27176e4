"""Tokenizers and chat templates: the real SmolLM2 tokenizer against the transformers reference, the chat
formats, template guessing, and a SentencePiece model trained here."""
import json
from pathlib import Path

import pytest

from generate import default_checkpoint
from tokenizer import (HFTokenizer, SentencePieceTokenizer, apply_chat_template, default_system_prompt,
                       get_tokenizer, guess_chat_template, incremental_decoder)

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"


# ---------------------------------------------------------------- real SmolLM2 tokenizer vs transformers

@pytest.fixture(scope="module")
def smollm2():
    """(tokenizer, checkpoint config, reference); the checkpoint is converted from the GGUF on first use."""
    checkpoint = default_checkpoint()
    return (get_tokenizer(checkpoint), json.loads((checkpoint / "config.json").read_text()),
            json.loads((DATA / "smollm2_reference.json").read_text()))


def test_smollm2_encodes_text_like_transformers(smollm2):
    tok, _, ref = smollm2
    text = (ROOT / ref["text"]["file"]).read_text(encoding="utf-8")
    assert len(text) == ref["text"]["n_chars"]  # the file was read unchanged (no newline translation)
    ids = tok.encode(text)
    assert ids == ref["text"]["ids"]
    assert tok.decode(ids) == text
    assert tok.encode(ref["tokenizer"]["probe"]["text"]) == ref["tokenizer"]["probe"]["ids"]
    for token, key in (("<|im_start|>", "im_start_id"), ("<|im_end|>", "im_end_id"), ("<|endoftext|>", "endoftext_id")):
        assert tok.token_id(token) == ref["tokenizer"][key]


def streamed(tok, ids):
    push = incremental_decoder(tok)
    return [push(i) for i in ids]


def test_incremental_decoder_streams_the_whole_decode(smollm2):
    import random
    tok = smollm2[0]
    text = "Caf\u00e9 na\u00efve \u2014 \u65e5\u672c\u8a9e\u306e\u6587 \U0001F600\U0001F680 x  y\n\n\tdone. <|im_end|>"
    ids = tok.encode(text)
    pieces = streamed(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == text
    assert "" in pieces  # a character split over tokens prints once complete, not as a replacement character
    assert all("\ufffd" not in p for p in pieces)
    rng = random.Random(0)  # any ids, odd bytes included: still exactly the full decode, piece by piece
    for _ in range(20):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 60))]
        full = tok.decode(ids)
        joined = "".join(streamed(tok, ids))
        assert joined == (full if not full.endswith("\ufffd") else joined) and full.startswith(joined)


def test_smollm2_chatml_prompts_like_transformers(smollm2):
    tok, config, ref = smollm2
    assert config["chat_template"] == "chatml"
    for r in ref["greedy"]["results"]:
        text = apply_chat_template([{"role": "user", "content": r["prompt"]}], "chatml",
                                   config.get("default_system_prompt"))
        assert text == r["formatted"]
        assert tok.encode(text) == r["prompt_ids"]
        # decoding keeps special tokens and spacing exactly as transformers' decode(skip_special_tokens=False)
        assert tok.decode(r["new_ids"]) == r["new_text"]


# ---------------------------------------------------------------- chat formats

def msgs(*turns, system=None):
    out = [{"role": "system", "content": system}] if system is not None else []
    return out + [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]


def test_chatml():
    assert apply_chat_template(msgs("Hi"), "chatml") == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert apply_chat_template(msgs("Hi", "Hello!", "Bye"), "chatml", "Be brief") == (
        "<|im_start|>system\nBe brief<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n")
    # a system message in the conversation wins over the default system prompt
    assert apply_chat_template(msgs("Hi", system="Mine"), "chatml", "Default") == \
        apply_chat_template(msgs("Hi"), "chatml", "Mine")


def test_llama3():
    header = "<|start_header_id|>{}<|end_header_id|>\n\n"
    assert apply_chat_template(msgs("Hi", "Hello!", "Bye"), "llama-3", "Be brief") == (
        "<|begin_of_text|>" + header.format("system") + "Be brief<|eot_id|>" + header.format("user") + "Hi<|eot_id|>"
        + header.format("assistant") + "Hello!<|eot_id|>" + header.format("user") + "Bye<|eot_id|>"
        + header.format("assistant"))
    # without a system prompt there is no system block; contents are trimmed as Meta's template does
    assert apply_chat_template(msgs("  Hi\n"), "llama-3") == \
        "<|begin_of_text|>" + header.format("user") + "Hi<|eot_id|>" + header.format("assistant")


def test_llama2():
    assert apply_chat_template(msgs("Hi"), "llama-2") == "<s>[INST] Hi [/INST]"
    assert apply_chat_template(msgs("Hi", "Hello!", "Bye"), "llama-2", "Be brief") == (
        "<s>[INST] <<SYS>>\nBe brief\n<</SYS>>\n\nHi [/INST] Hello! </s><s>[INST] Bye [/INST]")
    # the system prompt goes into the first user turn only
    assert apply_chat_template(msgs("Hi", "Hello!", "Bye", system="S"), "llama-2").count("<<SYS>>") == 1


def test_vicuna():
    from tokenizer import VICUNA_SYSTEM
    assert apply_chat_template(msgs("Hi"), "vicuna") == f"<s>{VICUNA_SYSTEM} USER: Hi ASSISTANT:"
    # FastChat's vicuna_v1.1 separators: " " after a user turn, "</s>" right after a reply
    assert apply_chat_template(msgs("Hi", "Hello!", "Bye"), "vicuna", "S") == \
        "<s>S USER: Hi ASSISTANT: Hello!</s>USER: Bye ASSISTANT:"


def test_plain_and_unknown_templates():
    assert apply_chat_template(msgs("Hi"), "none") == "Hi"
    with pytest.raises(ValueError, match="unknown chat template 'alpaca'"):
        apply_chat_template(msgs("Hi"), "alpaca")


SMOLLM2_JINJA = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                 "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                 "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                 "'<|im_end|>' + '\n'}}{% endfor %}")
LLAMA3_JINJA = ("{% for message in messages %}{% set content = '<|start_header_id|>' + message['role'] + "
                "'<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{{ content }}{% endfor %}")
LLAMA2_JINJA = "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + message['content'] + ' [/INST]' }}{% endif %}"
VICUNA_JINJA = "{% if message['role'] == 'user' %}{{ 'USER: ' + message['content'] + ' ASSISTANT:' }}{% endif %}"


@pytest.mark.parametrize("chat_template, expected", [
    (SMOLLM2_JINJA, "chatml"), (LLAMA3_JINJA, "llama-3"), (LLAMA2_JINJA, "llama-2"), (VICUNA_JINJA, "vicuna"),
    ([{"name": "default", "template": LLAMA3_JINJA}, {"name": "tool_use", "template": "{{ tools }}"}], "llama-3"),
    ("{{ messages[0]['content'] }}", "none"), (None, "none"),
])
def test_guess_chat_template(tmp_path, chat_template, expected):
    path = tmp_path / "tokenizer_config.json"
    path.write_text(json.dumps({"bos_token": "<s>", "chat_template": chat_template}))
    assert guess_chat_template(path) == expected


def test_guess_chat_template_without_template(tmp_path):
    assert guess_chat_template(tmp_path / "missing.json") == "none"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    assert guess_chat_template(tmp_path / "tokenizer_config.json") == "none"


def test_default_system_prompt():
    assert default_system_prompt(SMOLLM2_JINJA) == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    # Qwen2.5 style: the user's system message is concatenated first, the default follows; quotes are escaped
    qwen = ("{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}{%- else %}"
            "{{- '<|im_start|>system\nYou\\'re Qwen.<|im_end|>\n' }}")
    assert default_system_prompt(qwen) == "You're Qwen."
    assert default_system_prompt("{{'<|im_start|>system\n' + system + '<|im_end|>'}}") is None
    assert default_system_prompt(LLAMA3_JINJA) is None


# ---------------------------------------------------------------- SentencePiece

SP_TEXT = """The quick brown fox jumps over the lazy dog. A small model learns a tiny vocabulary.
Hello world, hello tokenizer. SentencePiece splits words into pieces and marks the spaces.
The user asks a question and the assistant gives a short answer."""


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory):
    import sentencepiece as spm
    d = tmp_path_factory.mktemp("sp")
    spm.SentencePieceTrainer.train(sentence_iterator=iter(SP_TEXT.splitlines() * 20), model_prefix=str(d / "tokenizer"),
                                   vocab_size=100, model_type="bpe", minloglevel=2)
    (d / "tokenizer.vocab").unlink()
    return d


def test_sentencepiece_chosen_for_tokenizer_model(sp_dir):
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=str(sp_dir / "tokenizer.model"))
    tok = get_tokenizer(sp_dir)
    assert isinstance(tok, SentencePieceTokenizer) and tok.vocab_size == 100
    assert tok.encode("hello world") == sp.encode("hello world")
    assert tok.decode(tok.encode("The user asks a question")) == "The user asks a question"
    assert tok.token_id("</s>") == sp.eos_id() and tok.token_id("no-such-piece") is None


def test_incremental_decoder_with_sentencepiece_spaces(sp_dir):
    tok = get_tokenizer(sp_dir)
    ids = tok.encode("The user asks a question and the assistant gives a short answer")
    pieces = streamed(tok, ids)
    assert "".join(pieces) == tok.decode(ids) and pieces[0] == "The" and any(p.startswith(" ") for p in pieces)


def test_sentencepiece_bos_eos_in_text(sp_dir):
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=str(sp_dir / "tokenizer.model"))
    tok = get_tokenizer(sp_dir)
    bos, eos = sp.bos_id(), sp.eos_id()
    # SentencePiece itself would spell "<s>" out as pieces (with unknowns); the tokenizer makes it one id
    assert len(sp.encode("<s>")) > 1
    assert tok.encode("<s>hello world</s>") == [bos] + sp.encode("hello world") + [eos]
    prompt = apply_chat_template(msgs("hello", "world", "again"), "llama-2")
    ids = tok.encode(prompt)
    assert ids[0] == bos and ids.count(bos) == 2 and ids.count(eos) == 1
    assert ids[:ids.index(eos) + 1] == [bos] + sp.encode("[INST] hello [/INST] world ") + [eos]


def test_tokenizer_json_preferred_and_missing(sp_dir, tmp_path):
    from tokenizers import Tokenizer, models
    both = tmp_path / "both"
    both.mkdir()
    (both / "tokenizer.model").write_bytes((sp_dir / "tokenizer.model").read_bytes())
    Tokenizer(models.BPE(vocab={"a": 0}, merges=[])).save(str(both / "tokenizer.json"))
    assert isinstance(get_tokenizer(both), HFTokenizer)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        get_tokenizer(tmp_path / "empty")


def test_a_corrupt_tokenizer_file_is_a_value_error(tmp_path):
    from tokenizer import get_tokenizer
    (tmp_path / "tokenizer.json").write_text("version https://git-lfs.github.com/spec/v1\n")  # cloned without git-lfs
    with pytest.raises(ValueError, match="corrupt .*tokenizer.json"):
        get_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    (tmp_path / "tokenizer.model").write_bytes(b"\x00" * 32)
    with pytest.raises(ValueError, match="corrupt .*tokenizer.model"):
        get_tokenizer(tmp_path)
