"""Training data: documents from files, K3 chat transcripts with assistant-only loss, and the
grain pipeline that packs them into fixed-length rows.

Inputs (``load_documents``):

- Plain text (any file not ending in ``.jsonl``): one file is one document, or, with a
  ``doc_separator``, the pieces between separators are. Encoded as ordinary text (specials
  are plain text) followed by ``[EOS]``; every token is a target.
- ``.jsonl`` chat transcripts: one ``{"messages": [...], "tools": [...]}`` object per line in
  OpenAI form (roles system / user / assistant / tool; assistants may carry
  ``reasoning_content``, ``content``, ``tool_calls``). Optional ``"thinking"`` (bool, default
  true) and ``"thinking_effort"`` select the render options; other keys are ignored.
  Rendered with ``render_k3`` (no generation prompt, no ``[EOS]`` appended); the loss covers
  only what the model writes after each assistant generation prompt: reasoning, the closing
  think tag, the response and tools channels and ``<|close|>message<|sep|><|end_of_msg|>``.
- A directory stands for its ``*.txt``, ``*.py``, ``*.md`` and ``*.jsonl`` files, recursively,
  sorted, skipping hidden files and folders.

Splits: a document is held out when a hash of (seed, its content) falls below
``holdout_fraction``, so the split depends only on the document itself (identical copies
land on the same side, adding files moves nothing). ``"train"`` shuffles documents per epoch
and rows per pack and repeats; ``"heldout"`` is one pass in file order, unshuffled, with the
last batch padded by empty rows.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import grain
import numpy as np
from jaxtyping import Bool, Int

from k31jax.chat import THINKING_EFFORTS, ChatTemplateError, Segment, TokenizerBase, render_k3
from k31jax.train._packing import batch_for_process, pack_rows, split_into_pieces, target_byte_table

CHAT_SUFFIX = ".jsonl"
DIRECTORY_SUFFIXES = (".txt", ".py", ".md", CHAT_SUFFIX)
ROLES = ("system", "user", "assistant", "tool")
SPLITS = ("train", "heldout", "all")
# Tokenizing is the heavy per-document step; a few threads keep ahead of the trainer.
_READ_OPTIONS = grain.ReadOptions(num_threads=4, prefetch_buffer_size=64)


class DataFormatError(ValueError):
    """Unusable training input; the message names the file (and JSONL line)."""


# ---- documents ---------------------------------------------------------------------------
def _content_id(kind: str, payload: str) -> str:
    return hashlib.sha256(f"{kind}\0{payload}".encode("utf-8")).hexdigest()


@dataclasses.dataclass(frozen=True)
class TextDocument:
    """Plain text. ``source`` names the file (``path#k`` for the k-th separated piece);
    ``doc_id`` is a content hash, the document's identity for the held-out split."""

    source: str
    text: str
    doc_id: str = dataclasses.field(init=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "doc_id", _content_id("text", self.text))


@dataclasses.dataclass(frozen=True)
class ChatDocument:
    """One chat transcript. ``source`` is ``path:line``; ``doc_id`` a content hash."""

    source: str
    messages: tuple[Mapping[str, Any], ...]
    tools: Any = None
    thinking: bool = True
    thinking_effort: str | None = None
    doc_id: str = dataclasses.field(init=False, repr=False)

    def __post_init__(self):
        payload = json.dumps(
            [list(self.messages), self.tools, self.thinking, self.thinking_effort],
            sort_keys=True, ensure_ascii=False, separators=(",", ":"),
        )
        object.__setattr__(self, "doc_id", _content_id("chat", payload))


Document = TextDocument | ChatDocument


def assistant_output_spans(doc: ChatDocument) -> tuple[list[Segment], list[tuple[int, int]]]:
    """The transcript's segments and, per assistant turn, the ``[start, stop)`` segment range
    the model generates.

    For assistant message ``i``: ``start`` is the length of the prompt the model would get
    (``messages[:i]`` + generation prompt), ``stop`` the length of ``messages[:i + 1]``
    rendered. Segments are BPE'd one by one, so segment ranges map to token ranges. Costs one
    render per assistant turn (quadratic in the turn count; rendering is cheap next to BPE).
    Raises ``ChatTemplateError`` when a turn does not continue its generation prompt (an
    assistant ``name`` attribute, which the generation prompt never renders).
    """
    def render(messages, add_generation_prompt):
        return render_k3(messages, doc.tools, thinking=doc.thinking,
                         thinking_effort=doc.thinking_effort, require_reasoning=False,
                         add_generation_prompt=add_generation_prompt)

    full = render(doc.messages, False)
    spans = []
    for i, message in enumerate(doc.messages):
        if message.get("role") != "assistant":
            continue
        prompt = render(doc.messages[:i], True)
        turn = render(doc.messages[: i + 1], False)
        if full[: len(prompt)] != prompt or full[: len(turn)] != turn:
            raise ChatTemplateError(
                f"messages[{i}] (assistant): the rendered turn does not continue the generation "
                "prompt (an assistant 'name' does this), so its output tokens are undefined"
            )
        spans.append((len(prompt), len(turn)))
    return full, spans


def encode_document(
    doc: Document, tokenizer: TokenizerBase
) -> tuple[Int[np.ndarray, "L"], Bool[np.ndarray, "L"]]:
    """``(tokens int32[L], trained bool[L])``: ``trained[i]`` marks tokens that are loss
    targets when predicted (all of a text document, assistant output of a transcript)."""
    if isinstance(doc, TextDocument):
        if tokenizer.eos_id is None:
            raise ValueError("the tokenizer has no [EOS] token to end text documents with")
        ids = tokenizer.encode_ordinary(doc.text) + [tokenizer.eos_id]
        return np.asarray(ids, np.int32), np.ones(len(ids), bool)
    segments, spans = assistant_output_spans(doc)
    per_segment = [tokenizer.encode_segments([s]) for s in segments]
    offsets = np.cumsum([0] + [len(ids) for ids in per_segment])
    trained = np.zeros(offsets[-1], bool)
    for start, stop in spans:
        trained[offsets[start] : offsets[stop]] = True
    tokens = np.asarray([t for ids in per_segment for t in ids], np.int32)
    return tokens, trained


# ---- loading -------------------------------------------------------------------------------
def _is_hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def _expand(paths: Iterable[str | os.PathLike]) -> list[Path]:
    files = []
    for path in map(Path, paths):
        if path.is_dir():
            found = sorted(f for f in path.rglob("*") if f.is_file()
                           and f.suffix in DIRECTORY_SUFFIXES and not _is_hidden(f, path))
            if not found:
                raise DataFormatError(f"{path}: the directory holds no {'/'.join(DIRECTORY_SUFFIXES)} files")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"training data path {path} does not exist")
    return files


def _decode(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataFormatError(
            f"{where}: not UTF-8 text (line {line}, byte {e.start}: {data[e.start:e.start + 4]!r})"
        ) from None


def _text_documents(path: Path, doc_separator: str | None) -> list[TextDocument]:
    text = _decode(path.read_bytes(), str(path))
    if doc_separator is None:
        return [TextDocument(str(path), text)] if text.strip() else []
    return [TextDocument(f"{path}#{k}", piece)
            for k, piece in enumerate(text.split(doc_separator)) if piece.strip()]


def _transcript(obj: Any, where: str) -> ChatDocument:
    if not isinstance(obj, dict):
        raise DataFormatError(f"{where}: expected a JSON object with 'messages', got {type(obj).__name__}")
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        raise DataFormatError(f"{where}: 'messages' must be a non-empty list")
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ROLES:
            got = f"role {role!r}" if isinstance(m, dict) else f"a {type(m).__name__}"
            raise DataFormatError(f"{where}: messages[{i}] has {got}; expected an object with role in {list(ROLES)}")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataFormatError(f"{where}: the transcript has no assistant message, so nothing to train on")
    tools = obj.get("tools")
    if tools is not None and not isinstance(tools, (list, dict)):
        raise DataFormatError(f"{where}: 'tools' must be a list (or dict), got {type(tools).__name__}")
    thinking = obj.get("thinking", True)
    if not isinstance(thinking, bool):
        raise DataFormatError(f"{where}: 'thinking' must be true or false, got {thinking!r}")
    effort = obj.get("thinking_effort")
    if effort is not None and effort not in THINKING_EFFORTS:
        raise DataFormatError(f"{where}: 'thinking_effort' {effort!r} is not one of {list(THINKING_EFFORTS)}")
    doc = ChatDocument(where, tuple(messages), tools or None, thinking, effort)
    try:
        assistant_output_spans(doc)  # render now, so template errors name the line
    except ChatTemplateError as e:
        raise DataFormatError(f"{where}: {e}") from None
    return doc


def _chat_documents(path: Path) -> list[ChatDocument]:
    docs = []
    for lineno, raw in enumerate(path.read_bytes().split(b"\n"), 1):
        where = f"{path}:{lineno}"
        line = _decode(raw, where)
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataFormatError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
        docs.append(_transcript(obj, where))
    return docs


def load_documents(
    paths: str | os.PathLike | Iterable[str | os.PathLike], *, doc_separator: str | None = None
) -> list[Document]:
    """Read every document of ``paths`` (files or directories), in path order.

    ``.jsonl`` files are chat transcripts, everything else plain text; whitespace-only text
    documents are skipped. Errors (``FileNotFoundError``, ``DataFormatError``) name the file
    and, for transcripts, the line: missing path, non-UTF-8 bytes, bad JSON, an unknown role,
    a transcript without assistant turns or one the K3 template rejects.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    docs: list[Document] = []
    for path in _expand(paths):
        if path.suffix == CHAT_SUFFIX:
            docs.extend(_chat_documents(path))
        else:
            docs.extend(_text_documents(path, doc_separator))
    return docs


# ---- configuration and pipeline ------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DataConfig:
    """What to read and how to batch it.

    ``seed`` orders the training stream; ``holdout_seed`` alone picks the held-out documents,
    so runs with different shuffling seeds are evaluated on the same text.
    ``num_epochs=None`` repeats the training split forever. ``num_processes`` /
    ``process_index``: each process gets its ``batch_size`` rows of every global batch of
    ``num_processes * batch_size`` rows. ``packing_bins``: rows the first-fit packer fills at
    once (more bins, less padding). ``doc_separator``: split text files into documents.
    """

    paths: tuple[str, ...]
    seq_len: int
    batch_size: int
    seed: int = 0
    holdout_fraction: float = 0.05
    holdout_seed: int = 0
    num_epochs: int | None = None
    num_processes: int = 1
    process_index: int = 0
    doc_separator: str | None = None
    packing_bins: int = 64

    def __post_init__(self):
        paths = [self.paths] if isinstance(self.paths, (str, os.PathLike)) else self.paths
        object.__setattr__(self, "paths", tuple(os.fspath(p) for p in paths))
        problems = []
        if not self.paths:
            problems.append("paths is empty")
        if self.seq_len < 2:
            problems.append(f"seq_len {self.seq_len} < 2")
        if self.batch_size < 1:
            problems.append(f"batch_size {self.batch_size} < 1")
        if not 0 <= self.seed < 2**32:
            problems.append(f"seed {self.seed} outside [0, 2**32)")
        if not 0.0 <= self.holdout_fraction < 1.0:
            problems.append(f"holdout_fraction {self.holdout_fraction} outside [0, 1)")
        if self.num_epochs is not None and self.num_epochs < 1:
            problems.append(f"num_epochs {self.num_epochs} < 1 (use None to repeat forever)")
        if not 0 <= self.process_index < self.num_processes:
            problems.append(f"process_index {self.process_index} outside [0, num_processes={self.num_processes})")
        if self.packing_bins < 1:
            problems.append(f"packing_bins {self.packing_bins} < 1")
        if self.doc_separator == "":
            problems.append("doc_separator is empty")
        if problems:
            raise ValueError("DataConfig: " + "; ".join(problems))


def is_heldout(doc: Document, seed: int, holdout_fraction: float) -> bool:
    """Whether ``doc`` belongs to the held-out split (a hash of seed and content)."""
    digest = hashlib.sha256(f"{seed}\0{doc.doc_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < holdout_fraction * 2.0**64


def split_documents(cfg: DataConfig, split: str) -> list[Document]:
    """The documents of ``split`` in load order; raises if the split is empty."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not one of {list(SPLITS)}")
    want_heldout = split == "heldout"
    docs = [d for d in load_documents(cfg.paths, doc_separator=cfg.doc_separator)
            if split == "all" or is_heldout(d, cfg.holdout_seed, cfg.holdout_fraction) == want_heldout]
    if not docs:
        raise ValueError(
            f"the {split} split of {list(cfg.paths)} is empty (holdout_fraction="
            f"{cfg.holdout_fraction}, holdout_seed={cfg.holdout_seed})"
        )
    return docs


class _EncodePieces:
    """Document → its list of pieces (runs in grain's reader threads)."""

    def __init__(self, tokenizer: TokenizerBase, seq_len: int):
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.byte_table = target_byte_table(tokenizer)

    def __call__(self, doc: Document) -> list[dict[str, np.ndarray]]:
        tokens, trained = encode_document(doc, self.tokenizer)
        return split_into_pieces(tokens, trained, self.seq_len, self.byte_table)


def make_dataset(cfg: DataConfig, tokenizer: TokenizerBase, split: str) -> grain.IterDataset:
    """Batches of ``[batch_size, seq_len]`` row fields (see ``k31jax.train._packing``).

    ``iter(ds)`` is a grain ``DatasetIterator``; its ``get_state()`` / ``set_state()``
    resume the stream exactly. ``"train"``: documents shuffled per epoch by ``cfg.seed``,
    rows shuffled within each pack, ``cfg.num_epochs`` passes (``None``: forever), a short
    final batch dropped. ``"heldout"``: one pass in file order, last batch zero-padded;
    ``"all"``: the same over every document (evaluating text that was never trained on).
    """
    docs = split_documents(cfg, split)
    source = grain.MapDataset.source(docs)
    train = split == "train"
    if train:  # shuffle before repeat: grain reshuffles each epoch with seed + epoch
        source = source.shuffle(seed=cfg.seed).repeat(cfg.num_epochs)
    pieces = source.map(_EncodePieces(tokenizer, cfg.seq_len)).to_iter_dataset(_READ_OPTIONS)
    rows = pack_rows(pieces, cfg.seq_len, num_bins=cfg.packing_bins, seed=cfg.seed, shuffle=train)
    return batch_for_process(rows, cfg.batch_size, num_processes=cfg.num_processes,
                             process_index=cfg.process_index, pad_last=not train)


def heldout_bytes(cfg: DataConfig, tokenizer: TokenizerBase) -> int:
    """``sum(target_bytes * loss_mask)`` over the whole held-out split (all processes
    together): the byte count for held-out bits per byte."""
    encode = _EncodePieces(tokenizer, cfg.seq_len)
    return sum(int(p["target_bytes"][p["loss_mask"] > 0].sum())
               for doc in split_documents(cfg, "heldout") for p in encode(doc))
