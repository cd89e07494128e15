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

Splits (``DataConfig.holdout_by``): by document, a document is held out when a hash of
(seed, its content) falls below ``holdout_fraction``, so the split depends only on the
document itself (identical copies land on the same side, adding files moves nothing). Too few
documents (fewer than ``1 / holdout_fraction``, or one side empty: one file at 0.05 is either
all training or all held out) make that split meaningless; then it is made inside the text:
every text document is cut into chunks of about ``chunk_chars`` characters at line ends (a
transcript is one chunk), the ``max(1, round(holdout_fraction * chunks))`` chunks with the
lowest hash of (seed, content) are held out, and each side's neighbouring chunks are joined
again. ``"auto"`` (the default) picks the document split when there are enough documents,
else the chunk split; `resolved_holdout` fixes the choice, and a training run records it in
its ``run.json``.
``"train"`` shuffles documents per epoch and rows per pack and repeats; ``"heldout"`` is one
pass in file order, unshuffled, with the last batch padded by empty rows.
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
HOLDOUT_UNITS = ("auto", "document", "chunk")
# Tokenizing is the heavy per-document step; a few threads keep ahead of the trainer.
_READ_OPTIONS = grain.ReadOptions(num_threads=4, prefetch_buffer_size=64)


class DataFormatError(ValueError):
    """Unusable training input; the message names the file (and JSONL line)."""


# ---- documents ---------------------------------------------------------------------------
def _content_id(kind: str, payload: str) -> str:
    return hashlib.sha256(f"{kind}\0{payload}".encode("utf-8")).hexdigest()


@dataclasses.dataclass(frozen=True)
class TextDocument:
    """Plain text. ``source`` names the file (``path#k`` for the k-th separated piece,
    ``path[a:b]`` for characters a to b of a chunk split); ``doc_id`` is a content hash, the
    document's identity for the held-out split. ``ends``: the text ends its file (or separated
    piece), so ``[EOS]`` follows it; a chunk cut off before the end gets none."""

    source: str
    text: str
    ends: bool = True
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
        ids = tokenizer.encode_ordinary(doc.text) + ([tokenizer.eos_id] if doc.ends else [])
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


def data_files(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """The files ``paths`` stand for (a directory: its data files, recursively, sorted)."""
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
            raise FileNotFoundError(f"data path {path} does not exist")
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
    for path in data_files(paths):
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
    ``num_epochs=None`` repeats the training split forever. ``batch_size`` counts the rows of
    a whole batch, all processes together: with ``num_processes`` / ``process_index`` each
    process gets its ``batch_size / num_processes`` rows of every batch, so a run's batches (and
    its saved position in them) do not depend on how many processes read them.
    ``shards``: the training stream is that many streams over disjoint documents (document i
    of the training split in shard ``i % shards``), each shuffled and packed on its own; every
    batch takes ``batch_size / shards`` rows from each, in shard order. A process reads
    (tokenizes, packs) only the shards its rows come from, so with ``shards`` a multiple of the
    process count no process encodes another's documents; the batches depend on ``shards``,
    not on the process count, and a checkpoint keeps each shard's position, so it resumes on
    any count (with ``num_epochs``, the stream ends where its first shard does). ``1``: one
    stream that every process reads whole, keeping its rows.
    ``packing_bins``: rows the first-fit packer fills at once (more bins, less padding). ``doc_separator``: split text files into documents.
    ``holdout_by`` / ``chunk_chars``: how the held-out split is made (the module docstring).
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
    shards: int = 1
    doc_separator: str | None = None
    packing_bins: int = 64
    holdout_by: str = "auto"
    chunk_chars: int = 2048

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
        if self.num_processes >= 1 and self.batch_size % self.num_processes:
            problems.append(f"batch_size {self.batch_size} (rows of all processes together) is not a multiple of "
                            f"num_processes {self.num_processes}")
        if self.shards < 1 or self.batch_size % self.shards:
            problems.append(f"shards {self.shards}: expected a divisor of batch_size {self.batch_size} (each shard "
                            "gives every batch the same number of rows)")
        if self.packing_bins < 1:
            problems.append(f"packing_bins {self.packing_bins} < 1")
        if self.doc_separator == "":
            problems.append("doc_separator is empty")
        if self.holdout_by not in HOLDOUT_UNITS:
            problems.append(f"holdout_by {self.holdout_by!r} is not one of {list(HOLDOUT_UNITS)}")
        if self.chunk_chars < 1:
            problems.append(f"chunk_chars {self.chunk_chars} < 1")
        if problems:
            raise ValueError("DataConfig: " + "; ".join(problems))


def is_heldout(doc: Document, seed: int, holdout_fraction: float) -> bool:
    """Whether ``doc`` belongs to the document-level held-out split (a hash of seed and content)."""
    digest = hashlib.sha256(f"{seed}\0{doc.doc_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < holdout_fraction * 2.0**64


def _chunk_cuts(text: str, size: int) -> list[int]:
    """Chunk boundaries ``[0, ..., len(text)]``: each chunk ends at the first line end after
    ``size`` characters, or at ``size`` characters when no line ends within ``2 * size``."""
    cuts = [0]
    while len(text) - cuts[-1] > size:
        start = cuts[-1]
        newline = text.find("\n", start + size, start + 2 * size)
        cut = start + size if newline < 0 else newline + 1
        if cut >= len(text):
            break
        cuts.append(cut)
    return cuts + [len(text)]


@dataclasses.dataclass(frozen=True)
class HoldoutSplit:
    """The training and held-out documents of a config's data, and how they were split:
    ``unit`` "document" or "chunk" (``units`` documents or chunks in all, ``held_out_units``
    of them held out), or "none" (``holdout_fraction`` 0, or text too short to cut in two)."""

    unit: str
    train: list[Document]
    heldout: list[Document]
    units: int
    held_out_units: int
    chunk_chars: int

    def line(self, fraction: float) -> str:
        """One line for users: which split is used, and why."""
        if self.unit == "document":
            return (f"held-out split: by document, {self.held_out_units} of {self.units} documents held out "
                    f"(holdout_fraction {fraction})")
        if self.unit == "chunk":
            return (f"held-out split: inside the text, {self.held_out_units} of {self.units} chunks of about "
                    f"{self.chunk_chars:,} characters held out (holdout_fraction {fraction}; too few documents "
                    "for a split by document)")
        if fraction == 0:
            return "no held-out split (holdout_fraction 0): training without evaluation"
        return (f"no held-out split: the data is {self.units} chunk of at most about {self.chunk_chars:,} "
                "characters, too little to hold any out; training without evaluation")


def _split_by_chunk(cfg: DataConfig, docs: list[Document]) -> HoldoutSplit:
    pieces = []  # (document index, start, stop); a transcript is one piece
    for i, doc in enumerate(docs):
        if isinstance(doc, TextDocument):
            cuts = _chunk_cuts(doc.text, cfg.chunk_chars)
            pieces.extend((i, a, b) for a, b in zip(cuts, cuts[1:]))
        else:
            pieces.append((i, 0, 0))

    def content(piece) -> str:
        i, a, b = piece
        doc = docs[i]
        return _content_id("text", doc.text[a:b]) if isinstance(doc, TextDocument) else doc.doc_id

    count = round(cfg.holdout_fraction * len(pieces))
    count = min(max(count, 1), len(pieces) - 1)
    rank = sorted(range(len(pieces)), key=lambda k: (hashlib.sha256(
        f"{cfg.holdout_seed}\0{content(pieces[k])}".encode()).digest(), k))
    held = set(rank[:count])
    train: list[Document] = []
    heldout: list[Document] = []
    k = 0
    while k < len(pieces):  # each side's neighbouring chunks of a document, joined again
        i, a, _ = pieces[k]
        side = k in held
        stop = k
        while stop + 1 < len(pieces) and pieces[stop + 1][0] == i and (stop + 1 in held) == side:
            stop += 1
        doc, b = docs[i], pieces[stop][2]
        if isinstance(doc, TextDocument):
            whole = a == 0 and b == len(doc.text)
            doc = doc if whole else TextDocument(f"{doc.source}[{a}:{b}]", doc.text[a:b],
                                                 ends=doc.ends and b == len(doc.text))
        (heldout if side else train).append(doc)
        k = stop + 1
    return HoldoutSplit("chunk", train, heldout, len(pieces), count, cfg.chunk_chars)


def holdout_split(cfg: DataConfig) -> HoldoutSplit:
    """``cfg``'s documents split into training and held-out ones."""
    docs = load_documents(cfg.paths, doc_separator=cfg.doc_separator)
    if cfg.holdout_fraction == 0:
        return HoldoutSplit("none", docs, [], len(docs), 0, cfg.chunk_chars)
    if cfg.holdout_by != "chunk":
        held = [is_heldout(d, cfg.holdout_seed, cfg.holdout_fraction) for d in docs]
        enough = cfg.holdout_fraction * len(docs) >= 1 and 0 < sum(held) < len(docs)
        if cfg.holdout_by == "document" or enough:
            return HoldoutSplit("document", [d for d, h in zip(docs, held) if not h],
                                [d for d, h in zip(docs, held) if h], len(docs), sum(held), cfg.chunk_chars)
    split = _split_by_chunk(cfg, docs)
    if not split.heldout:  # a single chunk: nothing to hold out
        return dataclasses.replace(split, unit="none")
    return split


def resolved_holdout(cfg: DataConfig) -> DataConfig:
    """``cfg`` with ``holdout_by="auto"`` replaced by the unit its data gets (so a run that
    records it is split the same way whatever data is added to an evaluation later)."""
    if cfg.holdout_by != "auto" or cfg.holdout_fraction == 0:
        return cfg
    unit = holdout_split(cfg).unit
    return dataclasses.replace(cfg, holdout_by="document" if unit == "document" else "chunk")


def split_documents(cfg: DataConfig, split: str) -> list[Document]:
    """The documents of ``split`` in load order; raises if the split is empty."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not one of {list(SPLITS)}")
    if split == "all":
        docs = load_documents(cfg.paths, doc_separator=cfg.doc_separator)
    else:
        parts = holdout_split(cfg)
        docs = parts.heldout if split == "heldout" else parts.train
    if not docs:
        raise ValueError(
            f"the {split} split of {list(cfg.paths)} is empty (holdout_fraction="
            f"{cfg.holdout_fraction}, holdout_seed={cfg.holdout_seed}, holdout_by={cfg.holdout_by!r})"
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


def make_dataset(cfg: DataConfig, tokenizer: TokenizerBase, split: str) -> grain.IterDataset | ShardedStream:
    """Batches of ``[batch_size / num_processes, T]`` row fields (see ``k31jax.train._packing``):
    this process's rows of every batch.

    ``iter(ds)`` has ``get_state()`` / ``set_state()``, which resume the stream exactly.
    ``"train"``: documents shuffled per epoch by ``cfg.seed``, rows shuffled within each pack,
    ``cfg.num_epochs`` passes (``None``: forever), a short final batch dropped; with
    ``cfg.shards`` > 1 a `ShardedStream`. ``"heldout"``: one pass in file order, last batch
    zero-padded; ``"all"``: the same over every document (evaluating text that was never
    trained on).
    """
    docs = split_documents(cfg, split)
    train = split == "train"
    if train and cfg.shards > 1:
        return ShardedStream(cfg, tokenizer, docs)
    return batch_for_process(_rows(cfg, tokenizer, docs, train, cfg.seed), cfg.batch_size,
                             num_processes=cfg.num_processes, process_index=cfg.process_index, pad_last=not train)


def _rows(cfg: DataConfig, tokenizer: TokenizerBase, docs: list[Document], train: bool, seed: int):
    source = grain.MapDataset.source(docs)
    if train:  # shuffle before repeat: grain reshuffles each epoch with seed + epoch
        source = source.shuffle(seed=seed).repeat(cfg.num_epochs)
    pieces = source.map(_EncodePieces(tokenizer, cfg.seq_len)).to_iter_dataset(_READ_OPTIONS)
    return pack_rows(pieces, cfg.seq_len, num_bins=cfg.packing_bins, seed=seed, shuffle=train)


class ShardedStream:
    """The training stream of ``DataConfig.shards`` > 1 as one process reads it: the shards
    whose rows of every batch are this process's, each its own grain pipeline (documents
    ``i % shards == shard``, its own shuffling seed), and nothing of the others."""

    def __init__(self, cfg: DataConfig, tokenizer: TokenizerBase, docs: list[Document]):
        per_shard, per_process = cfg.batch_size // cfg.shards, cfg.batch_size // cfg.num_processes
        if len(docs) < cfg.shards:
            raise ValueError(f"DataConfig: {len(docs)} training documents for shards={cfg.shards}: every shard needs "
                             "one (fewer shards, or doc_separator to split the files)")
        first = cfg.process_index * per_process  # this process's rows of a batch: [first, first + per_process)
        owned = range(first // per_shard, (first + per_process - 1) // per_shard + 1)
        self.rows = slice(first - owned.start * per_shard, first - owned.start * per_shard + per_process)
        self.shards = {shard: _rows(cfg, tokenizer, docs[shard::cfg.shards], True, _shard_seed(cfg.seed, shard))
                       .batch(per_shard, drop_remainder=True) for shard in owned}

    def __iter__(self) -> ShardedIterator:
        return ShardedIterator({shard: iter(ds) for shard, ds in self.shards.items()}, self.rows)


def _shard_seed(seed: int, shard: int) -> int:
    return (seed + shard * 0x9E3779B9) % 2**32  # shard 0 keeps the run's seed


class ShardedIterator:
    """Next: the owned shards' batches side by side, this process's rows of them. Its state
    names each shard's position; `merge_states` joins the states of every process into the
    state of the whole stream (what a checkpoint keeps, so it resumes on any process count)."""

    def __init__(self, iterators: dict[int, Any], rows: slice):
        self.iterators, self.rows = iterators, rows

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        parts = [next(self.iterators[shard]) for shard in sorted(self.iterators)]
        return {k: np.concatenate([p[k] for p in parts])[self.rows] for k in parts[0]}

    def get_state(self) -> dict:
        return {"shards": {str(shard): it.get_state() for shard, it in self.iterators.items()}}

    def set_state(self, state: dict) -> None:
        saved = state.get("shards", {}) if isinstance(state, dict) else {}
        missing = sorted(set(map(str, self.iterators)) - set(saved))
        if missing:
            raise ValueError(f"the saved data position has no state for shard(s) {', '.join(missing)}: it was "
                             "written with another DataConfig.shards")
        for shard, it in self.iterators.items():
            it.set_state(saved[str(shard)])

    @staticmethod
    def merge_states(states: list[dict]) -> dict:
        return {"shards": {k: v for state in states for k, v in state["shards"].items()}}


def heldout_bytes(cfg: DataConfig, tokenizer: TokenizerBase) -> int:
    """``sum(target_bytes * loss_mask)`` over the whole held-out split (all processes
    together): the byte count for held-out bits per byte."""
    encode = _EncodePieces(tokenizer, cfg.seq_len)
    return sum(int(p["target_bytes"][p["loss_mask"] > 0].sum())
               for doc in split_documents(cfg, "heldout") for p in encode(doc))
