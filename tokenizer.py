"""Tokenizers and chat templates.

The tokenizer is chosen by which file the checkpoint directory holds, not by its name:
`tokenizer.json` (Hugging Face `tokenizers`: LLaMA-3, SmolLM2, Mistral, ...) or `tokenizer.model`
(SentencePiece: LLaMA-2, Vicuna, TinyLlama). The chat template is named in the checkpoint's config.json.
"""
import json
import re
from pathlib import Path


class HFTokenizer:
    def __init__(self, path):
        from tokenizers import Tokenizer
        self.tok = Tokenizer.from_file(str(path))
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list:
        # special tokens written in the text (<|im_start|>, <|eot_id|>, ...) become their ids
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def token_id(self, token: str):
        return self.tok.token_to_id(token)


class SentencePieceTokenizer:
    """SentencePiece has no notion of special tokens in text: "<s>" and "</s>" in a chat string are
    split out here and become the BOS and EOS ids."""

    def __init__(self, path):
        import sentencepiece as spm
        self.sp = spm.SentencePieceProcessor(model_file=str(path))
        self.vocab_size = self.sp.vocab_size()

    def encode(self, text: str) -> list:
        ids = []
        for i, part in enumerate(text.split("<s>")):
            if i > 0:
                ids.append(self.sp.bos_id())
            for j, piece in enumerate(part.split("</s>")):
                if j > 0:
                    ids.append(self.sp.eos_id())
                if piece:
                    ids.extend(self.sp.encode(piece))
        return ids

    def decode(self, ids: list) -> str:
        return self.sp.decode(list(ids))

    def token_id(self, token: str):
        i = self.sp.piece_to_id(token)
        return None if i == self.sp.unk_id() and token != self.sp.id_to_piece(i) else i


def get_tokenizer(checkpoint_dir):
    checkpoint_dir = Path(checkpoint_dir)
    for name, kind in (("tokenizer.json", HFTokenizer), ("tokenizer.model", SentencePieceTokenizer)):
        if (checkpoint_dir / name).is_file():
            try:
                return kind(checkpoint_dir / name)
            except Exception as e:  # tokenizers and sentencepiece raise plain Exception / RuntimeError on a bad file
                raise ValueError(f"corrupt {checkpoint_dir / name}: {e}") from None
    raise FileNotFoundError(f"no tokenizer.json or tokenizer.model in {checkpoint_dir}")


VICUNA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. "
                 "The assistant gives helpful, detailed, and polite answers to the user's questions.")


def incremental_decoder(tokenizer):
    """push(token id) -> the text that token adds to the reply so far ("" while a character is still incomplete).
    Decodes a window of the last few tokens, not the whole reply (a decode of the whole reply a token made streaming
    quadratic in its length): the window's text before and after the new token, the difference printed. The first
    token of both decodes is the same, so a tokenizer's leading-space rule applies to both alike; the pieces joined
    are tokenizer.decode(every id)."""
    ids, window = [], [0, 0]  # window: where the decoded context starts, where the text printed so far ends

    def push(token) -> str:
        ids.append(token)
        start, end = window
        before = tokenizer.decode(ids[start:end])
        text = tokenizer.decode(ids[start:])
        if len(text) <= len(before) or text.endswith("\ufffd"):  # a split multi-byte character waits for the rest
            return ""
        window[:] = [end, len(ids)]
        return text[len(before):]

    return push


def apply_chat_template(messages: list, template: str, system_prompt=None) -> str:
    """messages: [{"role": "system"|"user"|"assistant", "content": str}, ...]. Returns the prompt text
    ending where the assistant's next reply starts. BOS is written as text ("<s>", "<|begin_of_text|>")
    where the format has one; the tokenizer turns it into its id."""
    if messages and messages[0]["role"] == "system":
        system_prompt, messages = messages[0]["content"], messages[1:]
    if template == "chatml":
        out = f"<|im_start|>system\n{system_prompt}<|im_end|>\n" if system_prompt else ""
        for m in messages:
            out += f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
        return out + "<|im_start|>assistant\n"
    if template == "llama-3":
        def block(role, text):  # Meta's template trims each message
            return f"<|start_header_id|>{role}<|end_header_id|>\n\n{text.strip()}<|eot_id|>"
        out = "<|begin_of_text|>" + (block("system", system_prompt) if system_prompt else "")
        for m in messages:
            out += block(m["role"], m["content"])
        return out + "<|start_header_id|>assistant<|end_header_id|>\n\n"
    if template == "llama-2":
        out, first = "", True
        for m in messages:
            if m["role"] == "user":
                text = m["content"].strip()
                if first and system_prompt:
                    text = f"<<SYS>>\n{system_prompt}\n<</SYS>>\n\n{text}"
                out += f"<s>[INST] {text} [/INST]"
                first = False
            else:
                out += f" {m['content'].strip()} </s>"
        return out
    if template == "vicuna":  # FastChat's vicuna_v1.1: separators " " after a user turn, "</s>" after a reply
        out = "<s>" + (system_prompt if system_prompt is not None else VICUNA_SYSTEM) + " "
        for m in messages:
            if m["role"] == "user":
                out += f"USER: {m['content']} "
            else:
                out += f"ASSISTANT: {m['content']}</s>"
        return out + "ASSISTANT:"
    if template in (None, "none"):
        return "".join(m["content"] for m in messages)
    raise ValueError(f"unknown chat template {template!r}; known: chatml, llama-3, llama-2, vicuna, none")


CHAT_TEMPLATES = ("chatml", "llama-3", "llama-2", "vicuna", "none")


def read_chat_template(tokenizer_config_path) -> str:
    """The Jinja chat template text of a Hugging Face tokenizer_config.json ("" if none)."""
    path = Path(tokenizer_config_path)
    text = (json.loads(path.read_text()).get("chat_template") or "") if path.is_file() else ""
    if isinstance(text, list):  # some configs hold several named templates
        text = " ".join(t.get("template", "") for t in text)
    return text


def guess_chat_template(tokenizer_config_path) -> str:
    """Names the chat format from a Hugging Face tokenizer_config.json's Jinja template, if any."""
    return chat_template_name(read_chat_template(tokenizer_config_path))


def chat_template_name(jinja_template: str) -> str:
    for marker, name in (("<|im_start|>", "chatml"), ("<|start_header_id|>", "llama-3"), ("[INST]", "llama-2"),
                         ("ASSISTANT:", "vicuna")):
        if marker in jinja_template:
            return name
    return "none"


def default_system_prompt(jinja_template: str):
    """The system prompt a ChatML Jinja template writes when the conversation has none (SmolLM2's does), or
    None. Only a whole quoted literal counts: '<|im_start|>system\\n' + message['content'] is no default."""
    m = re.search(r"'<\|im_start\|>system\n((?:[^'\\]|\\.)+?)<\|im_end\|>", jinja_template)
    return m.group(1).replace("\\'", "'") if m else None
