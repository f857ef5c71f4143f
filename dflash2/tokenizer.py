"""The project's own tokenizer: a byte-level BPE trained on the corpus.

Byte-level means the base alphabet is the 256 byte values, so every string
(any unicode, NUL, ``\\r\\n``, leading spaces) encodes and decodes back
exactly; BPE merges learned on the train split only make common code spans
short. It is returned as a ``transformers.PreTrainedTokenizerFast`` so it
saves next to the target with ``save_pretrained`` and any HF tool loads it.

Special tokens have fixed ids so configs can rely on them:
``<|endoftext|>`` = 0 (EOS, separates documents), ``<|pad|>`` = 1, and
``<|mask|>`` = 2 (the block-diffusion drafter's mask token). There is no BOS.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerFast

from dflash2.corpus import Document
from dflash2.errors import DFlash2Error

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = [EOS_TOKEN, PAD_TOKEN, MASK_TOKEN]  # ids 0, 1, 2 in this order

# The project's chat template (ARCHITECTURE.md §2.8): plain text with a role marker line per
# turn, e.g. "# <|user|>\nWrite the Python module json/decoder.py.\n# <|assistant|>\n".
# No special role tokens: new ids would change the vocabulary of every target already built
# (and stay untrained in its embedding). Marker lines that read as Python comments are what a
# target pretrained on raw code continues most naturally. It is applied by dflash2 to
# tokenizers without a template of their own (``data.chat.template``), not saved into the
# tokenizer files: prompt files of code-trained drafters stay plain continuations.
CHAT_TEMPLATE = (
    "{%- for message in messages %}# <|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}# <|assistant|>\n{% endif %}"
)
_BYTE_ALPHABET = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
_MIN_VOCAB = len(SPECIAL_TOKENS) + len(_BYTE_ALPHABET)  # 259: nothing smaller can cover all bytes
_MODEL_MAX_LENGTH = 1 << 30  # the model, not the tokenizer, limits length; avoid HF's length warnings


def train_bpe_tokenizer(
    texts: Iterable[str | Document],
    vocab_size: int = 2048,
    min_frequency: int = 2,
    max_train_bytes: int | None = 8_000_000,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``texts`` and wrap it for transformers.

    Reads texts in the given order until ``max_train_bytes`` UTF-8 bytes have
    been consumed (the text that crosses the limit is the last one): 8 MB of
    code trains a 2k-4k vocabulary in seconds on CPU, and more data barely
    changes the merges at that size. ``None`` reads everything. Deterministic:
    the same texts in the same order give the same vocabulary and merges.
    2048 is the default vocab because small vocabularies pay on CPU-sized
    targets (ARCHITECTURE.md §8).
    """
    if vocab_size < _MIN_VOCAB:
        raise DFlash2Error(
            f"tokenizer vocab_size {vocab_size} is below {_MIN_VOCAB} "
            "(256 bytes + 3 special tokens); raise tokenizer.vocab_size"
        )
    consumed = [0]  # bytes and texts seen by the generator, checked after training
    texts_seen = [0]

    def limited() -> Iterator[str]:
        for item in texts:
            text = item.text if isinstance(item, Document) else item
            yield text
            texts_seen[0] += 1
            consumed[0] += len(text.encode("utf-8"))
            if max_train_bytes is not None and consumed[0] >= max_train_bytes:
                return

    tok = Tokenizer(models.BPE())
    # No normalizer: NFC/NFKC would change the text and break the exact round trip.
    # add_prefix_space=False: a leading space must stay a real byte, not be invented.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)  # offsets only; adds no tokens
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,  # listed first, so they get ids 0, 1, 2
        initial_alphabet=_BYTE_ALPHABET,  # all 256 bytes even if the corpus lacks some
        show_progress=False,
    )
    tok.train_from_iterator(limited(), trainer=trainer)
    if texts_seen[0] == 0:
        raise DFlash2Error("no text to train the tokenizer on; check data.sources and the train split")
    for i, token in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(token) == i, f"{token} should have id {i}"
    return wrap_tokenizer(tok)


def wrap_tokenizer(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """A ``tokenizers.Tokenizer`` as a transformers tokenizer with our special tokens."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        mask_token=MASK_TOKEN,
        add_bos_token=False,
        add_eos_token=False,  # documents get EOS from encode_documents, not from every encode()
        model_max_length=_MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,  # cleanup rewrites " ." -> "." and breaks round trips
    )


def encode_documents(
    tokenizer,
    documents: Iterable[str | Document],
    *,
    add_eos: bool = True,
    batch_size: int = 256,
    show_progress: bool = True,
) -> np.ndarray:
    """Token ids of all documents concatenated, each followed by EOS: shape (N,), int32.

    This is the flat stream LM pretraining samples windows from; EOS marks
    where one document ends so the model learns not to continue across it.
    Documents are encoded in batches straight through the Rust backend
    (parallel over documents unless TOKENIZERS_PARALLELISM=false) with
    ``encode_batch_fast``, which skips computing character offsets: ~4x
    faster than ``tokenizer(...)`` on the stdlib, same ids.
    """
    eos = tokenizer.eos_token_id
    if add_eos and eos is None:
        raise DFlash2Error("the tokenizer has no eos_token; set one or pass add_eos=False")
    backend = tokenizer.backend_tokenizer
    encode_batch = getattr(backend, "encode_batch_fast", backend.encode_batch)  # _fast: tokenizers >= 0.20
    total = len(documents) if hasattr(documents, "__len__") else None
    chunks: list[np.ndarray] = []
    eos_arr = np.array([eos], dtype=np.int32) if add_eos else None

    def flush(batch: list[str]) -> None:
        for enc in encode_batch(batch, add_special_tokens=False):
            chunks.append(np.asarray(enc.ids, dtype=np.int32))
            if add_eos:
                chunks.append(eos_arr)

    batch: list[str] = []
    with tqdm(total=total, desc="tokenizing", unit="doc", disable=not show_progress) as bar:
        for doc in documents:
            batch.append(doc.text if isinstance(doc, Document) else doc)
            if len(batch) == batch_size:
                flush(batch)
                bar.update(len(batch))
                batch = []
        if batch:
            flush(batch)
            bar.update(len(batch))
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int32)


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of what makes two tokenizers interchangeable for a drafter.

    A drafter predicts ids of the target's vocabulary and uses one of them as its
    mask token, so a drafter trained with one tokenizer is meaningless under
    another with the same vocab size. The hash covers the token -> id map
    (added tokens included) and the special-token ids; it reads nothing that
    differs between transformers versions, so the GPU and CPU images agree.
    Any HF tokenizer works (not only the embedded BPE).
    """
    import hashlib
    import json

    special = {name: getattr(tokenizer, f"{name}_token_id", None) for name in ("eos", "pad", "bos", "unk", "mask")}
    payload = {"vocab": sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]), "special": special}
    return hashlib.sha256(json.dumps(payload, ensure_ascii=False).encode()).hexdigest()[:16]
