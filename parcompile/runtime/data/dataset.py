"""Real training data: tokenizers, corpora, a memory-mapped token cache, batches.

The pipeline is ``prepare`` (tokenize a corpus once into a cache directory) ->
``TokenCache`` (read-only, memory-mapped samples) -> ``TrainBatches`` / ``EvalBatches``
(the global batch of a step) -> ``local_rows`` (this data-parallel rank's micro-batches).

Shapes and conventions (design15 "Loss convention"): a batch is ``tokens`` (n, seq_len + 1)
int64 and ``targets`` (n, seq_len) int64 where ``targets[i, j] = tokens[i, j + 1]`` or
``-100`` (ignored: prompt tokens, non-assistant chat turns, padding).

Sources (the ``data`` / ``eval_data`` keys, see ``resolve_files``): a file, a directory
(its ``.txt``, ``.jsonl``, ``.parquet`` files, recursively, sorted by path), a glob, or
``"builtin:pydoc"`` (the text of Python's ``pydoc_data/topics.py``). A ``.txt`` file (or
any other explicitly named file) is one document, a ``.jsonl`` line is one, a
``.parquet`` row is one. ``"synthetic"`` is not handled here (see ``data.SyntheticBatches``).

Every user mistake raises ``DataError`` naming the data file and its 1-based line (jsonl
line, parquet row) where there is one.

Modules: this one holds the tokenizers, chat templates and ``prepare`` (the cache key, the
lock, the pipelined tokenization); :mod:`parcompile.runtime.data.files` the sources and their
records (and :class:`DataError`); :mod:`parcompile.runtime.serve.token_cache` the cache on disk
and the batches read from it. Every name stays importable from here.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from parcompile.core.files import MAX_JSON_BYTES, FileReadError, json_loads, read_text, what_is
# the files and records, the token cache and its batches live beside this module; their names
# stay importable from here (`from parcompile.runtime.data.dataset import TrainBatches`)
from parcompile.runtime.data.files import DATA_SUFFIXES, DataError, iter_records, json_type, resolve_files
from parcompile.runtime.serve.token_cache import (FORMAT_VERSION, IGNORE, CacheWriter, EvalBatches, TokenCache, TrainBatches,
                                            epoch_seed, local_rows)

DATA_FORMATS = ("text", "prompt_completion", "chat")
KNOWN_EOS = ("<|endoftext|>", "</s>", "<|im_end|>", "<eos>", "<|end_of_text|>", "<|eot_id|>")
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
_BATCH_CHARS = 1 << 20   # characters of text per encode_batch call
_BATCH_DOCS = 8192       # documents per encode_batch call
_PROGRESS_BYTES = 5_000_000

__all__ = ["DATA_FORMATS", "DATA_SUFFIXES", "FORMAT_VERSION", "IGNORE", "KNOWN_EOS", "SPECIAL_TOKEN_KEYS",
           "DataError", "Tokenizer", "load_tokenizer", "render_chat", "chat_spans", "resolve_files",
           "default_cache_dir", "cache_key", "TokenCache", "CacheWriter", "prepare", "epoch_seed", "TrainBatches",
           "EvalBatches", "local_rows", "iter_records", "json_type"]


# ----------------------------------------------------------------------------------------
# Tokenizers

_TOKENIZER_HELP = ('tokenizer may be "bytes", a tokenizer.json file, or a directory holding one '
                   "(a Hugging Face checkpoint directory)")


def _token_str(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class Tokenizer:
    """A tokenizer: ``"bytes"`` (a token is a byte) or a Hugging Face ``tokenizers`` one.

    Attributes:
        name: ``"bytes"`` or the tokenizer.json path.
        vocab_size: the largest token id + 1 (added tokens counted); 256 for bytes.
        eos_id: the end-of-text token (tokenizer_config.json ``eos_token``, else a known end
            token present in the vocabulary); None for bytes.
        bos_id, pad_id: from tokenizer_config.json (``bos_token``, ``pad_token``), or None.
        special_tokens: named special tokens (``eos_token``: "...", ...) as chat template
            variables, as transformers passes them.
        chat_template: the chat template (str) or None.
        files: the tokenizer files to copy into a Hugging Face output directory
            (tokenizer.json, tokenizer_config.json, special_tokens_map.json,
            chat_template.jinja, those present); empty for bytes.
    """

    def __init__(self, name: str, backend=None, *, config: dict | None = None, files: list[Path] = (),
                 chat_template: str | None = None):
        self.name = name
        self.backend = backend
        self.files = list(files)
        self.chat_template = chat_template
        config = config or {}
        self.special_tokens: dict[str, str] = {}
        for key in SPECIAL_TOKEN_KEYS:
            tok = _token_str(config.get(key))
            if tok is not None:
                self.special_tokens[key] = tok
        if backend is None:
            self.vocab_size = 256
            self.eos_id = self.bos_id = self.pad_id = None
            return
        vocab = backend.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        self.eos_id = self._id(self.special_tokens.get("eos_token"))
        if self.eos_id is None:
            for tok in KNOWN_EOS:
                if tok in vocab:
                    self.eos_id = vocab[tok]
                    break
        self.bos_id = self._id(self.special_tokens.get("bos_token"))
        self.pad_id = self._id(self.special_tokens.get("pad_token"))

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def is_bytes(self) -> bool:
        return self.backend is None

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, no special tokens added (multi-threaded in tokenizers)."""
        if self.backend is None:
            return [list(t.encode("utf-8")) for t in texts]
        return [e.ids for e in self.backend.encode_batch_fast(texts, add_special_tokens=False)]

    def digest(self) -> str:
        """A hash of the tokenizer files' content ("bytes" for the byte tokenizer)."""
        if self.backend is None:
            return "bytes"
        h = hashlib.sha256()
        for f in self.files:
            h.update(f.name.encode() + b"\0")
            h.update(hashlib.sha256(f.read_bytes()).digest())
        return h.hexdigest()

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


def _read_json_file(path: Path) -> dict:
    try:
        value = json_loads(read_text(path, MAX_JSON_BYTES))   # a regular file only, size-limited
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read: it {e.strerror}" if isinstance(e, FileReadError) else f"cannot read: {e}",
                        path) from None
    except json.JSONDecodeError as e:
        raise DataError(f"not valid JSON: {e.msg}", path, e.lineno) from None
    except RecursionError:   # json's decoder recurses once per `[` or `{`
        raise DataError("not valid JSON: nested too deeply to read", path) from None
    if not isinstance(value, dict):
        raise DataError(f"expected a JSON object, found {json_type(value)}", path)
    return value


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer named by the ``tokenizer`` key.

    ``spec`` is ``"bytes"``, a ``tokenizer.json`` file, or a directory holding one. The
    tokenizer_config.json (and special_tokens_map.json, chat_template.jinja) next to it
    give the special tokens and the chat template (chat_template.jinja wins over the
    config's ``chat_template``; a list of named templates gives its ``"default"``).

    Raises:
        DataError: the file or directory does not exist, holds no tokenizer.json, or a
            file there cannot be parsed (help says what ``tokenizer`` may be).
    """
    if spec == "bytes":
        return Tokenizer("bytes")
    from tokenizers import Tokenizer as HFTokenizer

    p = Path(spec)
    if p.is_dir():
        tj = p / "tokenizer.json"
        if not tj.is_file():
            raise DataError("directory holds no tokenizer.json", p, help=_TOKENIZER_HELP)
    elif p.is_file():
        tj = p
    else:
        what = what_is(p)
        raise DataError("tokenizer not found" if what == "does not exist" else f"tokenizer {what}", p,
                        help=_TOKENIZER_HELP)
    size = tj.stat().st_size
    if size > MAX_JSON_BYTES:   # tokenizers reads it whole (Gemma 3's, among the largest: 33 MB)
        raise DataError(f"tokenizer file is {size:,} bytes, more than the {MAX_JSON_BYTES:,} a tokenizer.json may have",
                        tj, help=_TOKENIZER_HELP)
    try:
        backend = HFTokenizer.from_file(str(tj))
    except Exception as e:  # tokenizers raises a plain Exception on a malformed file
        raise DataError(f"not a Hugging Face tokenizer file: {e}", tj, help=_TOKENIZER_HELP) from None
    folder = tj.parent
    files = [tj] + [folder / n for n in _TOKENIZER_FILES[1:] if (folder / n).is_file()]
    config: dict = {}
    cfg_path = folder / "tokenizer_config.json"
    if cfg_path.is_file():
        config = _read_json_file(cfg_path)
    stm_path = folder / "special_tokens_map.json"
    if stm_path.is_file():
        for key, value in _read_json_file(stm_path).items():
            if key in SPECIAL_TOKEN_KEYS and _token_str(config.get(key)) is None:
                config[key] = value
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    elif isinstance(template, dict):
        template = template.get("default")
    jinja_path = folder / "chat_template.jinja"
    if jinja_path.is_file():
        template = jinja_path.read_text(encoding="utf-8")
    if not isinstance(template, str):
        template = None
    return Tokenizer(str(tj), backend, config=config, files=files, chat_template=template)


# ----------------------------------------------------------------------------------------
# Chat templates (rendered as transformers' apply_chat_template renders them)

@lru_cache(maxsize=16)
def _compile_template(source: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    class _Generation(jinja2.ext.Extension):
        # `{% generation %}...{% endgeneration %}` renders its body (transformers' tracker tag)
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def render_chat(tokenizer: Tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The text of ``messages`` under the tokenizer's chat template, as transformers'
    ``apply_chat_template(messages, tokenize=False, add_generation_prompt=...)`` gives it.

    Raises: jinja2.TemplateError (the template's ``raise_exception`` or a template error).
    """
    template = _compile_template(tokenizer.chat_template)
    return template.render(messages=messages, tools=None, documents=None,
                           add_generation_prompt=add_generation_prompt, **tokenizer.special_tokens)


def chat_spans(tokenizer: Tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """(rendered text, character spans [start, end) of the assistant turns).

    An assistant turn's span is the text between the conversation before it rendered with
    ``add_generation_prompt=True`` and the conversation including it.

    Raises: ValueError when the template does not render prefixes stably;
        jinja2.TemplateError.
    """
    full = render_chat(tokenizer, messages)
    spans = []
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        before = render_chat(tokenizer, messages[:i], add_generation_prompt=True)
        upto = full if i == len(messages) - 1 else render_chat(tokenizer, messages[:i + 1])
        if not upto.startswith(before) or not full.startswith(upto):
            raise ValueError(f"the chat template renders the conversation before message {i + 1} "
                             "differently from the whole conversation, so its assistant turn cannot be found")
        if len(upto) > len(before):
            spans.append((len(before), len(upto)))
    return full, spans


def _offsets_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for tokens overlapping a span (transformers' assistant-mask rule), else 0."""
    mask = np.zeros(len(offsets), dtype=np.uint8)
    k = 0
    for t, (a, b) in enumerate(offsets):
        while k < len(spans) and a >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if b > spans[k][0]:
            mask[t] = 1
    return mask


def _file_digest(path: Path) -> bytes:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.digest()


def default_cache_dir() -> Path:
    """``$PARCOMPILE_CACHE``, else ``$XDG_CACHE_HOME/parcompile/tokens``, else
    ``~/.cache/parcompile/tokens``."""
    if os.environ.get("PARCOMPILE_CACHE"):
        return Path(os.environ["PARCOMPILE_CACHE"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "parcompile" / "tokens"
    return Path.home() / ".cache" / "parcompile" / "tokens"


def cache_key(files: list[Path], tokenizer: Tokenizer, data_format: str, text_field: str) -> str:
    """The cache subdirectory name: a hash of the format version, data_format, text_field,
    the tokenizer files' content, the file list and every file's content."""
    h = hashlib.sha256()
    for part in (FORMAT_VERSION, data_format, text_field, tokenizer.digest()):
        h.update(part.encode() + b"\0")
    for f in files:
        h.update(str(f.resolve()).encode() + b"\0")
        h.update(_file_digest(f))
    return h.hexdigest()[:32]


@contextlib.contextmanager
def _lock(path: Path):
    """An exclusive advisory lock, so concurrent preparers tokenize once (best effort)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    try:
        fh = open(path, "a+")
    except OSError:
        yield
        return
    with fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX)
        except OSError:
            pass
        yield


def _remove_stale(root: Path, key: str, age_s: float = 86400.0):
    """Delete temporary directories of ``key`` left by preparers that died a day ago or more."""
    now = time.time()
    for d in root.glob(f".tmp-{key}-*"):
        with contextlib.suppress(OSError):
            if now - d.stat().st_mtime > age_s:
                shutil.rmtree(d, ignore_errors=True)


def prepare(source: str, *, tokenizer: str | Tokenizer, data_format: str = "text", text_field: str = "text",
            cache_dir: str | os.PathLike | None = None, progress: bool | None = None) -> TokenCache:
    """Tokenize ``source`` once into a memory-mapped cache and open it.

    The cache lives in ``cache_dir`` (default ``default_cache_dir()``) under a subdirectory
    named by ``cache_key`` (the data files' content, their list, the tokenizer files,
    data_format, text_field, the format version): a second call with the same inputs
    reuses it (``TokenCache.reused`` is True, nothing is tokenized); editing a data file
    makes a new one. It is written into a temporary directory and renamed into place, so
    a reader never sees a partial cache; of concurrent preparers, one tokenizes (a file
    lock) and, should two race anyway, the loser of the rename uses the winner's cache.

    ``text``: every document's tokens followed by eos (none for bytes). ``prompt_completion``:
    ``prompt`` tokens (not loss) + ``completion`` tokens + eos (loss). ``chat``: the
    ``messages`` rendered by the chat template; loss on the assistant turns only; an
    example without an assistant turn is skipped (counted in ``warnings``). Examples with
    no loss token at all are skipped and counted the same way.

    ``text_field`` names the document field/column of ``text`` data; ``prompt_completion``
    reads the fields ``prompt`` and ``completion``, ``chat`` the field ``messages``.

    ``progress``: a tqdm bar on stderr (bytes read, tokens/s); None: when the corpus is
    over ~5 MB and stderr is a terminal.

    Raises:
        DataError: missing files or tokenizer, bad records (with the file and 1-based
            line/row), an empty dataset, a chat template that fails or is missing.
    """
    if data_format not in DATA_FORMATS:
        raise DataError(f"data_format = {data_format!r}; expected one of {', '.join(DATA_FORMATS)}")
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
    if data_format == "chat" and tok.chat_template is None:
        where = "the bytes tokenizer" if tok.is_bytes else "the tokenizer"
        raise DataError(f"data_format = chat needs a chat template; {where} has none",
                        None if tok.is_bytes else tok.name,
                        help="add chat_template to tokenizer_config.json (or a chat_template.jinja), "
                             "or use data_format = prompt_completion")
    files = resolve_files(source)
    key = cache_key(files, tok, data_format, text_field)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / key
    if (final / "meta.json").is_file():
        return _opened(final, True, source)
    root.mkdir(parents=True, exist_ok=True)
    with _lock(root / f".{key}.lock"):
        if (final / "meta.json").is_file():
            return _opened(final, True, source)
        _remove_stale(root, key)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=root))
        try:
            os.chmod(tmp, 0o755)   # mkdtemp makes it private; the cache is for every reader
            meta = _tokenize(files, tok, data_format, text_field, tmp, progress)
            meta.update(format=FORMAT_VERSION, data_format=data_format, text_field=text_field,
                        source=source, files=[str(f) for f in files], tokenizer=tok.name,
                        vocab_size=tok.vocab_size, eos_id=tok.eos_id, pad_id=tok.pad_id, key=key)
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
            try:
                os.rename(tmp, final)
            except OSError:
                if not (final / "meta.json").is_file():
                    raise
                return _opened(final, True, source)  # another preparer won the race
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return _opened(final, False, source)


def _opened(path: Path, reused: bool, source: str) -> TokenCache:
    cache = TokenCache(path, reused=reused)
    cache.source = source
    return cache


def _skip_notes(counts: dict) -> list[str]:
    """The examples ``prepare`` skipped, as warning texts."""
    out = []
    if counts["skipped_no_assistant"]:
        out.append(f"{counts['skipped_no_assistant']} chat examples have no assistant turn and were skipped")
    if counts["skipped_no_loss"]:
        out.append(f"{counts['skipped_no_loss']} examples have no loss token and were skipped")
    return out


def _progress_bar(total_bytes: int, progress: bool | None):
    """A tqdm bar over ``total_bytes`` on stderr, or None (``progress`` None: when the corpus is
    over :data:`_PROGRESS_BYTES` and stderr is a terminal)."""
    if progress is None:
        progress = total_bytes > _PROGRESS_BYTES and sys.stderr.isatty()
    if not progress:
        return None
    from tqdm import tqdm
    return tqdm(total=total_bytes, unit="B", unit_scale=True, file=sys.stderr, desc="tokenizing", dynamic_ncols=True)


def _encode(tok: Tokenizer, texts: list, offsets: bool) -> list:
    """Encode a batch of texts (bytes tokenizer: their UTF-8 bytes as uint8 arrays); with
    ``offsets``, encodings that keep character offsets (chat loss masks)."""
    if tok.is_bytes:
        return [np.frombuffer(t if isinstance(t, bytes) else t.encode("utf-8"), dtype=np.uint8) for t in texts]
    try:
        if offsets:
            return tok.backend.encode_batch(texts, add_special_tokens=False)
        return tok.backend.encode_batch_fast(texts, add_special_tokens=False)
    except Exception as e:   # tokenizers raises a bare Exception for a broken model (a missing [UNK])
        raise DataError(f"the tokenizer cannot encode the data: {e}", tok.files[0] if tok.files else None,
                        help="the tokenizer.json is broken or incomplete: use the tokenizer the model was "
                             "trained with") from None


def _ids(e) -> np.ndarray:
    """An encoding's token ids as an array (a bytes tokenizer's array as is)."""
    return e if isinstance(e, np.ndarray) else np.array(e.ids, dtype=np.uint32)


def _finish_text(encs, eos, writer: CacheWriter, counts: dict):
    """Write ``text`` documents: each one's tokens, then ``eos`` (when the tokenizer has one)."""
    arrays = [_ids(e) for e in encs]
    counts["content_tokens"] += sum(a.size for a in arrays)
    if eos is not None:
        arrays = [x for a in arrays for x in (a, eos)]
    writer.add(arrays)


def _finish_pc(encs, eos, writer: CacheWriter, counts: dict):
    """Write ``prompt_completion`` examples (``encs``: the prompts, then the completions):
    prompt + completion + eos, loss on the completion; an empty completion is skipped."""
    n = len(encs) // 2
    arrays, masks = [], []
    for k in range(n):
        p, c = _ids(encs[k]).astype(np.uint32), _ids(encs[n + k]).astype(np.uint32)
        if eos is not None:
            c = np.concatenate([c, eos])
        if c.size == 0:
            counts["skipped_no_loss"] += 1
            continue
        arrays.append(np.concatenate([p, c]))
        masks.append(np.concatenate([np.zeros(p.size, np.uint8), np.ones(c.size, np.uint8)]))
    writer.add(arrays, masks)


def _empty_dataset(files: list[Path], data_format: str, counts: dict) -> DataError:
    """The error for a corpus that gave no tokens (``text``) or no example with a loss token."""
    src = files[0] if len(files) == 1 else None
    what = "examples with a loss token" if data_format != "text" else "tokens"
    skipped = "; ".join(_skip_notes(counts)) or None
    return DataError(f"the dataset has no {what} ({counts['documents']} records in {len(files)} file(s))"
                     + (f": {skipped}" if skipped else ""),
                     src if src is not None else ", ".join(map(str, files[:3])) + (" ..." if len(files) > 3 else ""),
                     help={"text": "the files hold no text", "prompt_completion": "every example needs a "
                           "non-empty `completion`", "chat": "every example needs an assistant turn to train on"}
                     [data_format])


def _tokenize(files: list[Path], tok: Tokenizer, data_format: str, text_field: str, tmp: Path,
              progress: bool | None) -> dict:
    """Tokenize ``files`` into the cache directory ``tmp`` (:class:`CacheWriter`); the counts and
    sizes for meta.json. Reading, encoding and writing are pipelined in batches of
    :data:`_BATCH_CHARS` characters or :data:`_BATCH_DOCS` documents."""
    total_bytes = sum(f.stat().st_size for f in files)
    bar = _progress_bar(total_bytes, progress)
    writer = CacheWriter(tmp, masked=data_format != "text")
    start = time.perf_counter()
    counts = {"documents": 0, "skipped_no_assistant": 0, "skipped_no_loss": 0, "content_tokens": 0}
    eos = None if tok.eos_id is None else np.array([tok.eos_id], dtype=np.uint32)
    raw_bytes = tok.is_bytes and data_format == "text"
    pending: list[tuple[Path, int | None, Any]] = []
    pending_chars = 0
    pending_bytes = 0.0
    # Pipelined: tokenizers encodes batch k on a worker thread (it releases the GIL and
    # runs its own threads) while this thread converts and writes batch k - 1 and reads,
    # parses (and for chat renders) batch k + 1.
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="parcompile-tokenize")
    in_flight = None   # (future of encodings, finish(encodings), bytes)

    def complete():
        nonlocal in_flight
        if in_flight is None:
            return
        fut, finish, nbytes = in_flight
        in_flight = None
        finish(fut.result())
        if bar is not None:
            bar.update(nbytes)
            el = max(time.perf_counter() - start, 1e-9)
            bar.set_postfix_str(f"{writer.n / el / 1e6:.2f}M tok/s", refresh=False)

    def flush():
        nonlocal pending, pending_chars, pending_bytes, in_flight
        if not pending:
            return
        recs = [r for _, _, r in pending]
        counts["documents"] += len(recs)
        offsets = False
        if data_format == "text":
            texts, finish = recs, functools.partial(_finish_text, eos=eos, writer=writer, counts=counts)
        elif data_format == "prompt_completion":
            texts = [p for p, _ in recs] + [c for _, c in recs]
            finish = functools.partial(_finish_pc, eos=eos, writer=writer, counts=counts)
        else:
            texts, spans = _render_chats(pending, tok, counts)
            offsets = True

            def finish(encs, spans=spans):
                _finish_chat(encs, spans, writer, counts)
        fut = executor.submit(_encode, tok, texts, offsets)
        complete()
        in_flight = (fut, finish, pending_bytes)
        pending, pending_chars, pending_bytes = [], 0, 0.0

    try:
        for f in files:
            for line, rec, nbytes in iter_records(f, data_format, text_field, raw_bytes):
                pending_bytes += nbytes
                if rec is None:
                    continue
                pending.append((f, line, rec))
                pending_chars += len(rec) if isinstance(rec, (str, bytes)) else 256
                if pending_chars >= _BATCH_CHARS or len(pending) >= _BATCH_DOCS:
                    flush()
        flush()
        complete()
    finally:
        executor.shutdown(wait=True, cancel_futures=True)
        writer.close()
        if bar is not None:
            bar.close()
    if writer.n == 0 or writer.examples == 0 or (data_format == "text" and counts["content_tokens"] == 0):
        raise _empty_dataset(files, data_format, counts)
    warnings = _skip_notes(counts)
    elapsed = time.perf_counter() - start
    return dict(num_tokens=writer.n, num_examples=writer.examples if data_format != "text" else counts["documents"],
                max_token_id=writer.max_id, bytes=total_bytes, seconds=round(elapsed, 3),
                warnings=warnings, **counts)


def _render_chats(pending, tok: Tokenizer, counts: dict) -> tuple[list[str], list[list[tuple[int, int]]]]:
    """Render each conversation; returns (texts, assistant spans). Skips (and counts)
    conversations without an assistant turn."""
    import jinja2

    texts, spans_all = [], []
    for path, line, messages in pending:
        if not any(m["role"] == "assistant" for m in messages):
            counts["skipped_no_assistant"] += 1
            continue
        try:
            text, spans = chat_spans(tok, messages)
        except jinja2.TemplateError as e:
            raise DataError(f"the chat template failed on this conversation: {e}", path, line) from None
        except ValueError as e:
            raise DataError(str(e), path, line,
                            help="loss masks need a template that renders a conversation's prefix as the "
                                 "start of the whole; use another chat template") from None
        texts.append(text)
        spans_all.append(spans)
    return texts, spans_all


def _finish_chat(encs, spans_all, writer: CacheWriter, counts: dict):
    arrays, masks = [], []
    for e, spans in zip(encs, spans_all):
        m = _offsets_mask(e.offsets, spans)
        if not m.any():
            counts["skipped_no_loss"] += 1
            continue
        arrays.append(np.array(e.ids, dtype=np.uint32))
        masks.append(m)
    writer.add(arrays, masks)
