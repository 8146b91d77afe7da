"""Tokenizers: byte-level (the zero-dependency default), a local `tokenizer.json`, or a local Hugging Face
tokenizer folder; and `meshforge data tokenizer train`, a byte-level BPE trained on local text.

`tokenizers` and `transformers` are imported lazily (extras `data` and `hf`). Everything reads local files:
`from_pretrained` runs with `local_files_only=True`, so a name that is not a folder is refused, never fetched.
A tokenizer folder's chat template (jinja2, rendered by transformers itself) drives `data.format: chat`.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from meshforge.errors import DataError
from meshforge.progress import track

# ChatML, written into the folders `train_tokenizer` makes so that `data.format: chat` works with them
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
    " + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _need(module: str, extra: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"data.tokenizer needs the `{module}` package: pip install 'meshforge[{extra}]'") from None


class ByteTokenizer:
    """Each UTF-8 byte is one token (vocab 256); documents end with NUL (id 0)."""

    name = "byte-level"
    vocab_size = 256
    eos_id = 0
    pad_id = 0
    has_chat_template = False

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        ids, offsets = [], []
        for i, ch in enumerate(text):
            b = ch.encode("utf-8")
            ids += list(b)
            offsets += [(i, i + 1)] * len(b)
        return ids, offsets

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")  # specials have no bytes

    def fingerprint(self) -> dict[str, str]:
        return {}  # no files: "byte-level" is in every source's name

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        raise DataError("data.format=chat needs a tokenizer with a chat template: set data.tokenizer to a "
                        "tokenizer folder (e.g. one made by `meshforge data tokenizer train`)")


class HFTokenizer:
    """A `tokenizers.Tokenizer` (encoding, with character offsets) and, for a folder, the transformers tokenizer
    around it (special tokens, chat template)."""

    def __init__(self, path: str):
        p = Path(path)
        self.name = str(path)
        self._hf = None
        if p.is_dir():
            if not (p / "tokenizer.json").is_file():
                raise DataError(f"data.tokenizer: {path!r} has no tokenizer.json (only fast tokenizers are "
                                "supported: save one with `tokenizer.save_pretrained` from a fast tokenizer)")
            transformers = _need("transformers", "hf")
            try:
                self._hf = transformers.AutoTokenizer.from_pretrained(str(p), local_files_only=True)
            except Exception as err:  # a broken folder: one line, not a traceback
                raise DataError(f"data.tokenizer: cannot load the tokenizer folder {path!r}: "
                                f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from None
            self._tok = self._hf.backend_tokenizer
        elif p.is_file():
            tokenizers = _need("tokenizers", "data")
            try:
                self._tok = tokenizers.Tokenizer.from_file(str(p))
            except Exception as err:
                raise DataError(f"data.tokenizer: {path!r} is not a tokenizer.json file ({err})") from None
        else:
            raise DataError(f"data.tokenizer: {path!r} does not exist (a tokenizer.json file or a tokenizer folder; "
                            "make one with `meshforge data tokenizer train`)")
        self.vocab_size = len(self._hf) if self._hf is not None else self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._special_id("eos_token", ["<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>"])
        if self.eos_id is None:
            raise DataError(f"data.tokenizer: {path!r} defines no end-of-sequence token (eos_token, or one of "
                            "<|endoftext|> </s> <eos>): documents need one to end with")
        pad = self._special_id("pad_token", [])
        self.pad_id = self.eos_id if pad is None else pad
        self.has_chat_template = self._hf is not None and bool(getattr(self._hf, "chat_template", None))

    def fingerprint(self) -> dict[str, str]:
        """Its files, for a resume's check (`fingerprint.py`)."""
        from meshforge.data.fingerprint import files

        return files("data.tokenizer", [self.name])

    def _special_id(self, attr: str, fallbacks: list[str]) -> int | None:
        if self._hf is not None and getattr(self._hf, attr, None) is not None:
            return self._hf.convert_tokens_to_ids(getattr(self._hf, attr))
        for tok in fallbacks:
            i = self._tok.token_to_id(tok)
            if i is not None:
                return i
        return None

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        """Generation shows special tokens it did not stop on; evaluation skips them (`skip_special`)."""
        return self._tok.decode(ids, skip_special_tokens=skip_special)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        if not self.has_chat_template:
            raise DataError(f"data.format=chat: the tokenizer {self.name!r} has no chat template (set chat_template "
                            "in its tokenizer_config.json, or use data.format=prompt_completion)")
        try:
            return self._hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as err:
            raise DataError(f"data.format=chat: the chat template of {self.name!r} failed: "
                            f"{type(err).__name__}: {err}") from None


def load_tokenizer(path: str | None):
    return ByteTokenizer() if not path else HFTokenizer(path)


def check_vocab(tokenizer, vocab_size: int) -> None:
    """The model must have an embedding row for every token id. A larger model vocabulary is allowed (padded
    rows, as Hugging Face models pad to a multiple); those rows never appear as inputs or labels."""
    if tokenizer.vocab_size > vocab_size:
        raise DataError(f"data.tokenizer: {tokenizer.name} has {tokenizer.vocab_size} tokens but model.vocab_size="
                        f"{vocab_size}: set model.vocab_size={tokenizer.vocab_size} (or larger)")


def train_tokenizer(patterns: list[str], vocab_size: int, output: str) -> tuple[int, Path]:
    """Train a byte-level BPE on local text files; writes a Hugging Face tokenizer folder (tokenizer.json,
    tokenizer_config.json with a ChatML chat template) loadable by `data.tokenizer` and by transformers."""
    import glob

    files = sorted(f for pat in patterns for f in glob.glob(pat, recursive=True) if Path(f).is_file())
    if not files:
        raise DataError(f"data tokenizer train: {' '.join(patterns)} matches no file")
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise DataError(f"--vocab-size {vocab_size} is too small: a byte-level BPE needs at least "
                        f"{256 + len(SPECIAL_TOKENS)} (256 bytes + {len(SPECIAL_TOKENS)} special tokens)")
    tk = _need("tokenizers", "data")
    transformers = _need("transformers", "hf")
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())

    def texts():  # file by file, so the progress shows (rich on a terminal, plain lines otherwise)
        from meshforge.data.records import text_bytes

        for f in track(files, "tokenizer train: files read"):
            yield text_bytes(Path(f), "data tokenizer train").decode("utf-8")

    try:
        tok.train_from_iterator(texts(), trainer, length=len(files))
    except DataError:
        raise
    except Exception as err:
        raise DataError(f"data tokenizer train: {type(err).__name__}: {err}") from None
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                                pad_token="<|endoftext|>")
    fast.chat_template = CHATML_TEMPLATE
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return len(fast), out
