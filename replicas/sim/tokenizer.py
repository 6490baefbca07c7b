"""Deterministic text <-> token ids for the simulated replica, and the text it generates.

* :class:`WordTokenizer` (built in, no dependencies): text is cut into pieces the way byte-level
  BPE pre-tokenisers do (a word with its leading space, runs of digits, punctuation); a piece of
  the built-in vocabulary has a fixed id, any other piece is split into chunks of at most four
  characters whose ids come from a stable hash. Equal text prefixes therefore give equal ids
  (up to the last, possibly cut, piece), in every process. Chat messages are rendered in the
  ChatML shape the tests' tiny model uses.
* :class:`HFTokenizer`: a real ``tokenizer.json`` through the ``tokenizers`` library, and the
  model's Jinja chat template, so the ``tiny-cpu`` preset counts tokens exactly like the real
  tiny vLLM replica (``tidal sim --tokenizer DIR``).
* :class:`TextModel`: the simulated model's answers -- deterministic per (seed, prompt), drawn
  from the vocabulary, with an optional answer key (``--answer-key``, ``--accuracy``).

Example::

    tok = WordTokenizer()
    ids = tok.encode("hello world, hello")
    tok.decode(ids) == "hello world, hello"
    prompt = tok.render_chat([{"role": "user", "content": "hi"}])
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import zlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from tidal.replicas.words import COMMON_WORDS

__all__ = [
    "AnswerKey",
    "HFTokenizer",
    "SimTokenizer",
    "SegmentEncoder",
    "TextModel",
    "WordTokenizer",
    "flatten_messages",
    "load_tokenizer",
    "stable_hash",
]

# Pieces: an optional leading space with a word, digits (up to 3, like Llama 3), or punctuation;
# whitespace runs stay pieces of their own.
_PIECE = re.compile(r" ?[A-Za-z\u00c0-\uffff]+| ?[0-9]{1,3}| ?[^\sA-Za-z0-9\u00c0-\uffff]+|\s+")
_MAX_CHUNK = 4
_MAX_LEARNED = 1_000_000  # hashed pieces remembered for decoding answer texts
_MAX_CACHED = 200_000  # chunk -> id cache of the built-in tokenizer

VOCAB_WORDS: tuple[str, ...] = COMMON_WORDS + (
    "can",
    "will",
    "would",
    "should",
    "could",
    "may",
    "might",
    "must",
    "shall",
    "do",
    "does",
    "did",
    "has",
    "had",
    "was",
    "were",
    "been",
    "being",
    "not",
    "no",
    "yes",
    "so",
    "but",
    "if",
    "then",
    "than",
    "because",
    "while",
    "after",
    "before",
    "over",
    "under",
    "between",
    "into",
    "through",
    "more",
    "most",
    "less",
    "many",
    "much",
    "some",
    "any",
    "each",
    "every",
    "other",
    "another",
    "such",
    "same",
    "new",
    "old",
    "good",
    "great",
    "small",
    "large",
    "long",
    "short",
    "high",
    "low",
    "right",
    "left",
    "next",
    "last",
    "early",
    "late",
    "well",
    "also",
    "only",
    "just",
    "very",
    "we",
    "they",
    "he",
    "she",
    "his",
    "her",
    "their",
    "our",
    "your",
    "its",
    "them",
    "us",
    "him",
    "there",
    "here",
    "now",
    "today",
    "result",
    "value",
    "list",
    "table",
    "file",
    "line",
    "page",
    "step",
    "part",
    "case",
    "point",
    "fact",
    "idea",
    "plan",
    "test",
    "check",
    "run",
    "use",
    "make",
    "take",
    "give",
    "get",
    "see",
    "know",
    "think",
    "say",
    "find",
    "work",
    "call",
    "try",
    "ask",
    "need",
    "feel",
    "become",
    "leave",
    "put",
    "mean",
    "keep",
    "let",
    "begin",
    "seem",
    "help",
    "show",
    "hear",
    "play",
    "move",
    "live",
    "believe",
    "hold",
    "bring",
    "happen",
    "provide",
    "sit",
    "stand",
    "lose",
    "pay",
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def stable_hash(*parts: object) -> int:
    """A 64-bit hash that is the same in every process (Python's str hash is salted)."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(repr(p).encode())
        h.update(b"\x00")
    return int.from_bytes(h.digest(), "big")


class SimTokenizer(Protocol):
    """What the server needs from a tokenizer."""

    vocab_size: int
    eos_token_id: int

    def encode(self, text: str, *, remember: bool = False) -> list[int]: ...

    def encode_prompt(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def token_text(self, token_id: int) -> str: ...

    def render_chat(self, messages: Sequence[Mapping[str, Any]]) -> str: ...

    def answer_token_ids(self) -> Sequence[int]: ...


def flatten_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """Chat messages as a chat template sees them: role and text; a content made of text parts
    is joined with newlines, as vLLM does. Raises ``ValueError`` for a non-text part."""
    out: list[dict[str, str]] = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if (
                    not isinstance(part, Mapping)
                    or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)
                ):
                    raise ValueError("Only text content parts are supported by this model.")
                texts.append(part["text"])
            content = "\n".join(texts)
        out.append(
            {"role": str(m.get("role", "user")), "content": content if isinstance(content, str) else ""}
        )
    return out


def _chatml(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
    parts = [f"<|im_start|>{m.get('role', 'user')}\n{m.get('content') or ''}<|im_end|>\n" for m in messages]
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


class WordTokenizer:
    """The built-in deterministic tokenizer (see the module docstring)."""

    def __init__(self, vocab_size: int = 32768) -> None:
        fixed = list(SPECIAL_TOKENS)
        for w in VOCAB_WORDS:
            fixed += [w, " " + w, w.capitalize(), " " + w.capitalize()]
        fixed += [" ", "\n", ".", ",", "?", "!", ":", ";", " .", " ,", "\n\n"]
        if vocab_size < 2 * len(fixed):
            raise ValueError(f"vocab_size must be at least {2 * len(fixed)}")
        self.vocab_size = vocab_size
        self._fixed = {t: i for i, t in enumerate(fixed)}
        self._text = list(fixed)
        self._hashed_base = len(fixed)
        self.eos_token_id = self._fixed["<|im_end|>"]
        self._learned: dict[int, str] = {}
        self._chunk_ids: dict[str, int] = {}
        self._piece_cache: dict[str, tuple[int, ...]] = {}
        self._span = vocab_size - self._hashed_base
        # What the simulated model says: vocabulary words with a leading space.
        self._answer_ids = [self._fixed[" " + w] for w in VOCAB_WORDS]

    def _piece_ids(self, piece: str, out: list[int], remember: bool) -> None:
        i = self._fixed.get(piece)
        if i is not None:
            out.append(i)
            return
        cache = self._chunk_ids
        for start in range(0, len(piece), _MAX_CHUNK):
            chunk = piece[start : start + _MAX_CHUNK]
            tid = cache.get(chunk)
            if tid is None:
                # crc32 is stable across processes and cheap; two seeds make collisions rare.
                b = chunk.encode()
                tid = self._hashed_base + ((zlib.crc32(b) << 32) | zlib.crc32(b, 0x9E3779B9)) % self._span
                if len(cache) < _MAX_CACHED:
                    cache[chunk] = tid
            if remember and len(self._learned) < _MAX_LEARNED:
                self._learned.setdefault(tid, chunk)
            out.append(tid)

    def encode_prompt(self, text: str) -> list[int]:
        """A completion prompt's ids (the built-in tokenizer adds no special tokens)."""
        return self.encode(text)

    def special_tokens(self) -> dict[str, int]:
        """The special tokens text is split at before tokenising, with their ids."""
        return {t: self._fixed[t] for t in SPECIAL_TOKENS}

    def encode(self, text: str, *, remember: bool = False) -> list[int]:
        """Token ids of ``text``; ``remember`` keeps hashed pieces decodable (answer texts)."""
        out: list[int] = []
        cache = self._piece_cache
        for part in _split_special(text):
            if part in SPECIAL_TOKENS:
                out.append(self._fixed[part])
                continue
            for piece in _PIECE.findall(part):
                ids = None if remember else cache.get(piece)
                if ids is None:
                    buf: list[int] = []
                    self._piece_ids(piece, buf, remember)
                    ids = tuple(buf)
                    if len(cache) < _MAX_CACHED:
                        cache[piece] = ids
                out.extend(ids)
        return out

    def token_text(self, token_id: int) -> str:
        if 0 <= token_id < len(SPECIAL_TOKENS):
            return ""  # special tokens are not part of the text (skip_special_tokens)
        if 0 <= token_id < len(self._text):
            return self._text[token_id]
        # A hashed piece is not invertible unless it came from a remembered (answer) text.
        return self._learned.get(token_id, "\ufffd")

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.token_text(i) for i in ids)

    def render_chat(self, messages: Sequence[Mapping[str, Any]]) -> str:
        return _chatml(messages)

    def answer_token_ids(self) -> Sequence[int]:
        return self._answer_ids


_SPECIAL_RE = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_TOKENS) + ")")


def _split_special(text: str) -> list[str]:
    return [p for p in _SPECIAL_RE.split(text) if p]


class HFTokenizer:
    """A model directory's ``tokenizer.json`` and chat template (needs ``tokenizers``, ``jinja2``)."""

    def __init__(self, directory: str | Path) -> None:
        import importlib

        tokenizers = importlib.import_module("tokenizers")
        d = Path(directory)
        self._tok = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
        self.vocab_size = int(self._tok.get_vocab_size())
        config: dict[str, Any] = {}
        cfg_path = d / "tokenizer_config.json"
        if cfg_path.is_file():
            config = json.loads(cfg_path.read_text())
        template = config.get("chat_template")
        jinja_path = d / "chat_template.jinja"
        if template is None and jinja_path.is_file():
            template = jinja_path.read_text()
        self._template = None
        if isinstance(template, str):
            import jinja2.sandbox

            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            self._template = env.from_string(template)
        eos = config.get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        bos = config.get("bos_token")
        if isinstance(bos, dict):
            bos = bos.get("content")
        # What templates may reference besides the messages (Llama's start with {{ bos_token }}).
        self._template_vars = {
            "bos_token": bos if isinstance(bos, str) else "",
            "eos_token": eos if isinstance(eos, str) else "",
        }
        eos_id = self._tok.token_to_id(eos) if isinstance(eos, str) else None
        self.eos_token_id = int(eos_id) if eos_id is not None else 0
        self._specials = {
            int(i) for i, t in ((self._tok.token_to_id(s), s) for s in SPECIAL_TOKENS) if i is not None
        }
        self._cache: dict[int, str] = {}
        # Answer tokens: ids whose text is a plain space-led word, so answers read as words.
        vocab: dict[str, int] = self._tok.get_vocab()
        words = sorted(
            i for t, i in vocab.items() if t.startswith("\u0120") and t[1:].isalpha() and len(t) > 2
        )
        self._answer_ids = words[:512] or sorted(vocab.values())[:512]

    def encode(self, text: str, *, remember: bool = False) -> list[int]:
        """Ids of ``text`` alone (a rendered chat prompt: its template places the special tokens)."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_prompt(self, text: str) -> list[int]:
        """A completion prompt's ids with the tokenizer's special tokens (a BOS), as vLLM encodes it."""
        return list(self._tok.encode(text, add_special_tokens=True).ids)

    def special_tokens(self) -> dict[str, int] | None:
        """The added special tokens text is split at before tokenising, with their ids; ``None``
        when some added token strips the text around it (then pieces would not be exact)."""
        out: dict[str, int] = {}
        for tid, tok in self._tok.get_added_tokens_decoder().items():
            if tok.lstrip or tok.rstrip or tok.single_word or tok.normalized:
                return None
            out[str(tok.content)] = int(tid)
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def token_text(self, token_id: int) -> str:
        t = self._cache.get(token_id)
        if t is None:
            t = "" if token_id in self._specials else str(self._tok.decode([token_id]))
            self._cache[token_id] = t
        return t

    def render_chat(self, messages: Sequence[Mapping[str, Any]]) -> str:
        if self._template is None:
            return _chatml(messages)
        return str(
            self._template.render(messages=list(messages), add_generation_prompt=True, **self._template_vars)
        )

    def answer_token_ids(self) -> Sequence[int]:
        return self._answer_ids


class SegmentEncoder:
    """Encodes rendered chat prompts piece by piece, remembering recent pieces.

    A tokenizer splits its input at special tokens before anything else, so the text between
    two of them (a system prompt, one turn) tokenises the same wherever it appears. Caching those
    pieces (LRU, up to ``max_chars`` characters) means a shared system prompt and the earlier
    turns of a conversation are tokenised once, not with every request -- tokenising is most of
    what exact prefix matching costs a gateway. A tokenizer for which the split is not exact
    (``probe`` texts encode differently whole and in pieces) is used whole.

    Example::

        enc = SegmentEncoder(tokenizer)
        ids = enc.encode(tokenizer.render_chat(messages))   # == tokenizer.encode(...)
    """

    def __init__(
        self, tokenizer: SimTokenizer, *, max_chars: int = 16 << 20, probe: Sequence[str] = ()
    ) -> None:
        self.tokenizer = tokenizer
        self.max_chars = max_chars
        self._cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._chars = 0
        self.hits = 0
        self.misses = 0
        specials = tokenizer.special_tokens() if hasattr(tokenizer, "special_tokens") else None
        self._split: re.Pattern[str] | None = None
        self._ids: dict[str, int] = {}
        if specials:
            self._ids = dict(specials)
            self._split = re.compile(
                "(" + "|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)) + ")"
            )
            samples = list(probe) or [
                tokenizer.render_chat(
                    [
                        {"role": "system", "content": " Rules:\n - be brief.  "},
                        {"role": "user", "content": "Hello,  world!\n\n12345 caf\u00e9"},
                        {"role": "assistant", "content": " ok\t"},
                        {"role": "user", "content": "again?"},
                    ]
                )
            ]
            if any(self._pieces(t) != list(tokenizer.encode(t)) for t in samples):
                self._split = None  # pieces do not tokenise like the whole: no caching

    @property
    def segmenting(self) -> bool:
        return self._split is not None

    def _pieces(self, text: str) -> list[int]:
        assert self._split is not None
        out: list[int] = []
        ids = self._ids
        for part in self._split.split(text):
            if not part:
                continue
            special = ids.get(part)
            if special is not None:
                out.append(special)
            else:
                out.extend(self.tokenizer.encode(part))
        return out

    def encode(self, text: str) -> list[int]:
        """``tokenizer.encode(text)``, from cached pieces where it can."""
        if self._split is None:
            return list(self.tokenizer.encode(text))
        out: list[int] = []
        ids = self._ids
        cache = self._cache
        for part in self._split.split(text):
            if not part:
                continue
            special = ids.get(part)
            if special is not None:
                out.append(special)
                continue
            got = cache.get(part)
            if got is None:
                self.misses += 1
                got = tuple(self.tokenizer.encode(part))
                if len(part) <= self.max_chars // 4:
                    cache[part] = got
                    self._chars += len(part)
                    while self._chars > self.max_chars:
                        old, _ = cache.popitem(last=False)
                        self._chars -= len(old)
            else:
                self.hits += 1
                cache.move_to_end(part)
            out.extend(got)
        return out


def load_tokenizer(directory: str | Path | None) -> SimTokenizer:
    """``HFTokenizer(directory)`` when given, else the built-in :class:`WordTokenizer`."""
    return HFTokenizer(directory) if directory else WordTokenizer()


class AnswerKey:
    """Reference answers by prompt: JSONL lines ``{"prompt": ..., "answer": ...}``.

    A request matches on its last user message (chat) or its prompt (completions), compared
    after trimming surrounding whitespace.
    """

    MAX_ENTRIES = 100_000
    MAX_BYTES = 64 * 1024 * 1024

    def __init__(self, entries: Mapping[str, str]) -> None:
        self.entries = dict(entries)
        self._answers = sorted(set(self.entries.values()))

    @classmethod
    def load(cls, path: str | Path) -> AnswerKey:
        p = Path(path)
        if p.stat().st_size > cls.MAX_BYTES:
            raise ValueError(f"answer key {p} is larger than {cls.MAX_BYTES} bytes")
        entries: dict[str, str] = {}
        with p.open() as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    d = json.loads(line)
                    prompt, answer = d["prompt"], d["answer"]
                except (ValueError, KeyError, TypeError) as exc:
                    raise ValueError(f"{p}:{n}: expected {{'prompt': ..., 'answer': ...}} ({exc})") from None
                if not isinstance(prompt, str) or not isinstance(answer, str):
                    raise ValueError(f"{p}:{n}: prompt and answer must be strings")
                entries[prompt.strip()] = answer
                if len(entries) > cls.MAX_ENTRIES:
                    raise ValueError(f"{p}: more than {cls.MAX_ENTRIES} entries")
        return cls(entries)

    def lookup(self, prompt: str) -> str | None:
        return self.entries.get(prompt.strip())

    def wrong_answer(self, prompt: str, right: str, seed: int) -> str:
        """A deterministic answer that is not ``right`` (another entry's, or a stock one)."""
        others = [a for a in self._answers if a != right]
        if others:
            return others[stable_hash("wrong", seed, prompt) % len(others)]
        return "I am not sure." if right != "I am not sure." else "No."


class TextModel:
    """What the simulated model answers: deterministic per (seed, prompt), or the answer key's.

    ``plan(prompt_ids, key_prompt, ...)`` returns the forced token ids (an answer from the key)
    and the natural stop length (None: run to ``max_tokens``). ``next_token`` draws the other
    tokens from the tokenizer's answer vocabulary.
    """

    def __init__(
        self,
        tokenizer: SimTokenizer,
        *,
        seed: int = 0,
        answer_key: AnswerKey | None = None,
        accuracy: float = 1.0,
        output_len_median: int = 0,
    ) -> None:
        if not 0.0 <= accuracy <= 1.0:
            raise ValueError("accuracy must be within [0, 1]")
        self.tokenizer = tokenizer
        self.seed = seed
        self.answer_key = answer_key
        self.accuracy = accuracy
        self.output_len_median = output_len_median
        self._answer_ids = list(tokenizer.answer_token_ids())

    def answer(self, key_prompt: str | None, seed: int) -> list[int] | None:
        """The answer key's tokens for this prompt (right with probability ``accuracy``)."""
        if self.answer_key is None or key_prompt is None:
            return None
        right = self.answer_key.lookup(key_prompt)
        if right is None:
            return None
        u = stable_hash("accuracy", seed, key_prompt.strip()) / 2.0**64
        text = right if u < self.accuracy else self.answer_key.wrong_answer(key_prompt, right, seed)
        return self.tokenizer.encode(text, remember=True)

    def natural_length(self, prompt_key: int, seed: int) -> int | None:
        """Where the model stops by itself: log-normal around the median (sigma 0.8), or None."""
        if self.output_len_median <= 0:
            return None
        u = (stable_hash("length", seed, prompt_key) % 1_000_003 + 0.5) / 1_000_003
        z = _norm_ppf(u)
        return max(1, int(self.output_len_median * math.exp(0.8 * z)))

    def next_token(self, prompt_key: int, seed: int, index: int) -> int:
        ids = self._answer_ids
        return ids[hash((seed, prompt_key, index)) % len(ids)]


def _norm_ppf(p: float) -> float:
    # Acklam's rational approximation of the standard normal quantile (|error| < 1.2e-9).
    a = (
        -39.69683028665376,
        220.9460984245205,
        -275.9285104469687,
        138.3577518672690,
        -30.66479806614716,
        2.506628277459239,
    )
    b = (-54.47609879822406, 161.5858368580409, -155.6989798598866, 66.80131188771972, -13.28068155288572)
    c = (
        -0.007784894002430293,
        -0.3223964580411365,
        -2.400758277161838,
        -2.549732539343734,
        4.374664141464968,
        2.938163982698783,
    )
    d = (0.007784695709041462, 0.3224671290700398, 2.445134137142996, 3.754408661907416)
    lo = 0.02425
    if p < lo:
        q = math.sqrt(-2 * math.log(p))
        return (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) / (
            (((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1
        )
    if p > 1 - lo:
        q = math.sqrt(-2 * math.log(1 - p))
        return -(((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) / (
            (((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1
        )
    q = p - 0.5
    r = q * q
    return (
        (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5])
        * q
        / (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1)
    )
