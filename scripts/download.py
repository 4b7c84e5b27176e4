"""Download a LLaMA-family model from the Hugging Face Hub and convert it into this project's layout.

    python scripts/download.py --repo_id HuggingFaceTB/SmolLM2-135M-Instruct
    python scripts/download.py --repo_id meta-llama/Llama-3.2-1B-Instruct --hf_token hf_... --out checkpoints/L32
    python scripts/download.py --repo_id yuhuili/EAGLE3-LLaMA3.1-Instruct-8B --head   # -> heads/<name>, as published

Only the config, tokenizer and weight files are fetched, into a temporary directory beside the output that
is deleted after the conversion (scripts/convert_hf_checkpoint.py does the conversion).
"""
import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from scripts.convert_hf_checkpoint import convert_hf_checkpoint  # noqa: E402
from tokenizer import CHAT_TEMPLATES  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
META_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer.model", "tokenizer_config.json"]
SAFETENSORS = ["model.safetensors", "model-*.safetensors", "model.safetensors.index.json"]
TORCH_BIN = ["pytorch_model.bin", "pytorch_model-*.bin", "pytorch_model.bin.index.json"]


class DownloadError(Exception):
    pass


def snapshot_download(**kwargs) -> str:
    """huggingface_hub.snapshot_download, imported late; tests replace this function to run offline."""
    from huggingface_hub import snapshot_download as hub_snapshot_download
    return hub_snapshot_download(**kwargs)


def first_line(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def fetch(repo_id, local_dir, token=None) -> Path:
    """Fetches config, tokenizer and weights into local_dir. Safetensors are preferred; the .bin files are
    asked for only when a repository has none, as many repositories carry both (twice the download)."""
    from huggingface_hub import errors
    try:
        snapshot_download(repo_id=repo_id, local_dir=local_dir, token=token, allow_patterns=META_FILES + SAFETENSORS)
        if not any(Path(local_dir).glob("*.safetensors")):
            snapshot_download(repo_id=repo_id, local_dir=local_dir, token=token, allow_patterns=TORCH_BIN)
    except errors.GatedRepoError:
        raise DownloadError(f"{repo_id} is gated: accept its license on https://huggingface.co/{repo_id} "
                            "and pass --hf_token (or run `hf auth login`)") from None
    except errors.RepositoryNotFoundError:
        raise DownloadError(f"repository {repo_id} not found on the Hugging Face Hub "
                            "(if it is private, pass --hf_token)") from None
    except errors.LocalEntryNotFoundError as e:  # what the Hub client raises when it cannot connect
        raise DownloadError(f"could not reach the Hugging Face Hub for {repo_id}: {first_line(e)}") from None
    except (errors.HfHubHTTPError, OSError) as e:  # timeouts, server errors, disk full
        raise DownloadError(f"downloading {repo_id} failed: {first_line(e)}") from None
    except Exception as e:  # the Hub client's HTTP library's own errors (a bad proxy, a dropped connection)
        raise DownloadError(f"downloading {repo_id} failed: {type(e).__name__}: {first_line(e)}") from None
    return Path(local_dir)


def download(repo_id, out=None, token=None, chat_template=None, head=False) -> Path:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise DownloadError(f"bad --repo_id {repo_id!r}: expected owner/name of letters, digits, '-', '_' and '.', "
                            "e.g. HuggingFaceTB/SmolLM2-135M-Instruct") from None
    out = Path(out) if out else ROOT / ("heads" if head else "checkpoints") / repo_id.split("/")[-1]
    out.parent.mkdir(parents=True, exist_ok=True)
    if head:  # an EAGLE head is read as published (eagle_head.load_head knows the layouts): no conversion
        if out.exists():
            raise DownloadError(f"{out} exists already: remove it or pass another --out")
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.download"))
        try:
            fetch(repo_id, tmp, token)
            if not (tmp / "config.json").is_file():
                raise DownloadError(f"{repo_id} has no config.json: not an EAGLE head")
            for cache in tmp.glob(".cache"):  # the Hub client's bookkeeping, not part of the head
                shutil.rmtree(cache)
            tmp.rename(out)  # whole or not at all
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return out
    # beside the output, not in /tmp: the same disk, and /tmp is often too small for the weights
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.download") as tmp:
        hf_dir = fetch(repo_id, tmp, token)
        try:
            out = convert_hf_checkpoint(hf_dir, out, chat_template)
        except (FileNotFoundError, KeyError, ValueError) as e:
            raise DownloadError(f"converting {repo_id} failed: {e}") from None
    # the converter records the directory it read, a temporary one here: name the repository instead
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "source": f"hf:{repo_id}"}, indent=2) + "\n")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo_id", required=True, help="Hub repository, e.g. HuggingFaceTB/SmolLM2-135M-Instruct")
    p.add_argument("--out", default=None, help="output checkpoint directory (default: checkpoints/<name>)")
    p.add_argument("--hf_token", default=None, help="Hub access token, for gated or private repositories")
    p.add_argument("--chat_template", default=None, choices=CHAT_TEMPLATES,
                   help="override the chat format guessed from tokenizer_config.json")
    p.add_argument("--head", action="store_true",
                   help="the repository is an EAGLE head: keep its files as published (default out: heads/<name>)")
    a = p.parse_args(argv)
    try:
        out = download(a.repo_id, a.out, a.hf_token, a.chat_template, a.head)
    except DownloadError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
