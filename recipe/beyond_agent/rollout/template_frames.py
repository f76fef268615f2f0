"""The fixed text a chat template writes around message contents, learned once and proven, and an exact,
memoised encoder: what lets RolloutHandler append observations without re-rendering the whole chat.

Why it is exact. A rendering is `interleave(fixed texts, contents)` with fixed texts that depend only on
the conversation's *shape* (the roles, which assistant turns ended with the end-of-turn token and, where
the template tests it, which contents are empty) when two things hold:

1. Static: `analyse_template` reads the Jinja AST and accepts a template only if every read of a message
   content (`m.content`, `m['content']`, or a name set from one) is written to the output unchanged
   (alone, concatenated, or as the branch of an `x if cond else y`), or only tested for emptiness, or
   tested with a test that is constant for strings (`is string`, `is defined`). A filter (`| trim`), a
   method (`.split(...)`), a comparison or a loop over a content rejects the template, as do macros,
   `{% set %}` blocks, `{% filter %}` blocks (they could transform captured output), and `strftime_now`
   (the text would change with the clock). Content then cannot steer the rendering except through
   emptiness, which is part of the shape when the template tests it.
2. Dynamic: for each shape the handler meets, `TemplateFrames` renders the same shape twice with probe
   contents, once with unique markers (to cut out the fixed texts) and once with awkward contents
   (whitespace and newlines at both ends, unicode, quotes, backslashes, special-token look-alikes), and
   keeps the frame only if the second rendering is exactly the frame filled with the second contents,
   if the previous rendering plus the assistant turn is a prefix of it (the template extends, never
   rewrites) and if no other message's content shows up in the fixed text. This also catches what the
   AST reading cannot see, e.g. `message | tojson` escaping newlines and quotes.

A probe renders exactly the shape of the real conversation, not a sample of positions, so templates
that render the first user turn or the fifth message differently get their own, correct frame.

What falls back to the full rendering (the caller's slow path): a template rejected by the analysis, a
shape whose frame is not proven (including templates that rewrite earlier turns, where the slow path
raises its usual error), a tokenizer whose `apply_chat_template` is overridden, messages with fields other
than `role` and `content`, tools that are not JSON, and shapes past `MAX_SHAPES`.

Token ids: the delta text is encoded whole (one call), exactly as the slow path encodes its delta, so no
question of BPE merges across fixed text and content arises. `CachedEncoder` calls the Rust tokenizer
directly only when that is provably the call `tokenizer.encode(text, add_special_tokens=False)` makes
(same class methods, no truncation or padding set, same special-token splitting), and memoises results by
text (observations repeat, and the n samples of a task share their prompt).
"""

from __future__ import annotations

import copy
import json
import threading
import weakref
from array import array
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Sequence

from jinja2 import nodes

PATH_STATS: Counter = Counter()
"""How often each path served: prompt_fast/prompt_slow, observation_fast/observation_slow,
encode_cache_hit/encode_cache_miss. Approximate when many threads count at once (stats only)."""

MAX_SHAPES = 4096
"""Conversation shapes remembered per (tokenizer, template, tools), each with two probe renderings (a few
KB); later shapes use the slow path. A run meets tens to hundreds (turns x roles x length-stopped turns)."""
MAX_CACHED_TEXTS = 16_384
"""Texts remembered per tokenizer by CachedEncoder (oldest dropped first)."""
MAX_CACHED_TEXT_CHARS = 8_192
"""Longer texts are encoded without being remembered (bounds the memory of the cache)."""

# Tests whose result is the same for every string: they cannot make the rendering depend on content.
_CONSTANT_TESTS = frozenset({"string", "defined", "undefined", "none", "mapping", "sequence", "iterable",
                             "number", "integer", "float", "boolean"})
# Globals whose value changes between renderings: a frame learned now could be wrong later.
_NONDETERMINISTIC = frozenset({"strftime_now", "lipsum"})
# Statements that capture or transform rendered output, so "written to the output" would not be final.
_OPAQUE = (nodes.Macro, nodes.FilterBlock, nodes.AssignBlock, nodes.Include, nodes.Import,
           nodes.FromImport, nodes.Extends, nodes.Block)
_MARK_OPEN, _MARK_CLOSE = "\x02", "\x03"
# Second probe contents ('#' is replaced by the message index, so each position differs).
_AWKWARD = (
    " \n # has whitespace at both ends \n\t",
    "\n\n#\n\n",
    "«#» ünïcödé — 中文 🙂 \"double\" 'single' \\back\\slash {{ not jinja }} {% raw %}",
    "<|im_end|>#</tool_response></think> <|eot_id|><|im_start|>user\n",
    "   #",
    "#  ",
)


# ----- 1. static analysis -------------------------------------------------------------------------


@dataclass(frozen=True)
class ContentFlow:
    """Where message contents go in a chat template, as far as its AST shows."""

    verbatim: bool
    """Every content read is written to the output unchanged, or only tested (for emptiness or type)."""
    tests_emptiness: bool
    """Some branch depends on whether a content is empty (then emptiness is part of the shape)."""
    reason: str = ""
    """Why the template is not `verbatim` (empty if it is)."""


@lru_cache(maxsize=64)
def analyse_template(template: str) -> ContentFlow:
    """Check that message contents reach a template's output unchanged (see the module docstring)."""
    try:
        tree = _parse(template)
    except Exception as exc:  # a template we cannot parse is not one we can reason about
        return ContentFlow(False, False, f"cannot parse the template: {exc}")
    reason = _opaque_construct(tree)
    if reason:
        return ContentFlow(False, False, reason)
    aliases = _content_aliases(tree)
    uses = [(_use_of(node, parents), node) for node, parents in _walk(tree) if _is_content_read(node, aliases)]
    for use, node in uses:
        if use == "other":
            return ContentFlow(False, False, f"a content is transformed or inspected at line {node.lineno}")
    return ContentFlow(True, any(use == "test" for use, _ in uses))


def _parse(template: str) -> nodes.Template:
    """Parse with the environment transformers renders with (its `generation` tag included)."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        environment = _compile_jinja_template(template).environment
    except ImportError:
        import jinja2

        environment = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    return environment.parse(template)


def _walk(node: nodes.Node, parents: tuple = ()):
    """Every node with its ancestors, outermost first."""
    yield node, parents
    for child in node.iter_child_nodes():
        yield from _walk(child, parents + (node,))


def _opaque_construct(tree: nodes.Template) -> str:
    """A reason the analysis cannot vouch for this template, or '' if there is none."""
    for node, parents in _walk(tree):
        if isinstance(node, _OPAQUE) or (isinstance(node, nodes.CallBlock) and not _is_generation_tag(node)):
            return f"{type(node).__name__} at line {node.lineno} may transform rendered text"
        if isinstance(node, nodes.Name) and node.name in _NONDETERMINISTIC:
            return f"{node.name} at line {node.lineno} changes between renderings"
        if isinstance(node, nodes.Const) and node.value == "content" and not _is_content_key(node, parents):
            return f"'content' used as a value at line {node.lineno} (e.g. a computed read of a content)"
    return ""


def _is_generation_tag(node: nodes.CallBlock) -> bool:
    # transformers' {% generation %} only marks where assistant text is; it returns its body unchanged.
    call = node.call
    return isinstance(call, nodes.Call) and getattr(call.node, "name", None) == "_generation_support"


def _is_content_key(node: nodes.Const, parents: tuple) -> bool:
    return bool(parents) and isinstance(parents[-1], nodes.Getitem) and parents[-1].arg is node


def _is_content_read(node: nodes.Node, aliases: set[str]) -> bool:
    """`x.content`, `x['content']`, or the load of a name that was set from one."""
    if isinstance(node, nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name in aliases


def _content_aliases(tree: nodes.Template) -> set[str]:
    """Names `{% set name = <content> %}` binds (transitively); their loads are content reads too."""
    aliases: set[str] = set()
    while True:
        found = set()
        for node, parents in _walk(tree):
            if _is_content_read(node, aliases):
                use = _use_of(node, parents)
                if use.startswith("alias:"):
                    found.add(use[len("alias:"):])
        if found <= aliases:
            return aliases
        aliases |= found


def _use_of(read: nodes.Node, parents: tuple) -> str:
    """How a content read is used: 'output', 'test', 'constant', 'identity', 'alias:<name>' or 'other'."""
    child, boolean = read, False
    for parent in reversed(parents):
        if isinstance(parent, nodes.Output):
            return "other" if boolean else "output"
        if isinstance(parent, (nodes.If, nodes.CondExpr)) and child is parent.test:
            return "identity" if not boolean and _is_identity(parent) else "test"
        if isinstance(parent, (nodes.CondExpr, nodes.Add, nodes.Concat)) and not boolean:
            child = parent  # a branch value or a concatenation: the content is still written as is
            continue
        if isinstance(parent, (nodes.Not, nodes.And, nodes.Or)):
            child, boolean = parent, True  # only its truth value flows on
            continue
        if isinstance(parent, nodes.Test) and child is parent.node and not boolean:
            return "constant" if parent.name in _CONSTANT_TESTS else "other"
        if isinstance(parent, nodes.Assign) and child is parent.node and not boolean:
            return f"alias:{parent.target.name}" if isinstance(parent.target, nodes.Name) else "other"
        return "other"
    return "other"


def _is_identity(node: nodes.Node) -> bool:
    # `c if c else ''` is `c` for every string: the test changes nothing.
    return (isinstance(node, nodes.CondExpr) and node.test == node.expr1
            and isinstance(node.expr2, nodes.Const) and node.expr2.value == "")


# ----- 2. frames, per conversation shape ------------------------------------------------------------


@dataclass(frozen=True)
class Frame:
    """Fixed texts around the contents of a step's messages: texts[0] c[slots[0]] texts[1] ... texts[-1]."""

    texts: tuple[str, ...]
    slots: tuple[int, ...]
    """Indices of the step's messages whose content sits between the texts (empty ones may be left out)."""

    def render(self, contents: Sequence[str]) -> str:
        """The step's text for these contents."""
        if len(self.slots) == 1:  # the common step (one observation): no list to build
            return self.texts[0] + contents[self.slots[0]] + self.texts[1]
        parts = [self.texts[0]]
        for slot, text in zip(self.slots, self.texts[1:]):
            parts.append(contents[slot])
            parts.append(text)
        return "".join(parts)


class TemplateFrames:
    """Frames of one (tokenizer, template, tools, end-of-turn token), learned per conversation shape.

    A shape is a tuple of message items `(role, ended, empty)`; shapes are numbered (0 is the empty
    conversation) and a handler walks them step by step: the initial messages, then each
    (assistant turn + observations). `step(parent, items)` gives the next shape and the frame of the
    step's text, or None when it is not proven (the caller renders in full).
    """

    def __init__(self, tokenizer: Any, tools: list[dict] | None, end_of_turn_text: str, flow: ContentFlow):
        self.tests_emptiness = flow.tests_emptiness
        """Whether items must record which contents are empty."""
        self._tokenizer = tokenizer
        self._tools = tools
        self._end_of_turn_text = end_of_turn_text
        self._lock = threading.Lock()
        self._items: list[tuple] = [()]
        self._steps: dict[tuple[int, tuple], tuple[int, Frame | None]] = {}
        self._probes: dict[int, tuple[str, str] | None] = {0: ("", "")}

    def step(self, parent: int, items: tuple) -> tuple[int, Frame | None]:
        """The shape after adding `items` to shape `parent`, and the proven frame of their text (learned on
        first use; None if unproven). Shape -1 stands for any shape past MAX_SHAPES."""
        key = (parent, items)
        known = self._steps.get(key)
        if known is None:
            with self._lock:
                known = self._steps.get(key)
                if known is None:
                    known = self._steps[key] = self._new_step(parent, items)
        return known

    def _new_step(self, parent: int, items: tuple) -> tuple[int, Frame | None]:
        if parent < 0 or len(self._items) >= MAX_SHAPES:
            return -1, None
        shape = len(self._items)
        self._items.append(self._items[parent] + items)
        return shape, self._learn(parent, shape)

    def _learn(self, parent: int, shape: int) -> Frame | None:
        items = self._items[shape]
        renders = self._probe_renders(items)
        self._probes[shape] = renders
        before = self._probes.get(parent)
        if renders is None or before is None:
            return None
        return _derive_frame(items, len(self._items[parent]), before, renders, self._end_of_turn_text)

    def _probe_renders(self, items: tuple) -> tuple[str, str] | None:
        try:
            return tuple(self._render(_probe_messages(items, kind)) for kind in (0, 1))
        except Exception:  # e.g. raise_exception on this shape: the slow path will raise it for real
            return None

    def _render(self, messages: list[dict]) -> str:
        return self._tokenizer.apply_chat_template(
            messages, tools=self._tools, tokenize=False, add_generation_prompt=True
        )


def _probe_content(kind: int, index: int, item: tuple) -> str:
    """Probe content of message `index`: a unique marker (kind 0) or an awkward string (kind 1)."""
    if item[2]:
        return ""  # the real content is empty, and this template tests emptiness
    if kind == 0:
        return f"{_MARK_OPEN}{index}{_MARK_CLOSE}"
    return _AWKWARD[index % len(_AWKWARD)].replace("#", str(index))


def _probe_messages(items: tuple, kind: int) -> list[dict]:
    return [{"role": item[0], "content": _probe_content(kind, i, item)} for i, item in enumerate(items)]


def _derive_frame(items: tuple, first: int, before: tuple[str, str], renders: tuple[str, str],
                  end_of_turn_text: str) -> Frame | None:
    """Cut the step's fixed texts out of the marker rendering; keep them only if the awkward one agrees."""
    # A step after the initial messages starts with the assistant turn, whose text our ids already hold.
    opens_with_turn = first > 0
    deltas = []
    for kind in (0, 1):
        head = before[kind]
        if opens_with_turn:
            item = items[first]
            head += _probe_content(kind, first, item) + (end_of_turn_text if item[1] else "")
        if not renders[kind].startswith(head):
            return None  # the template rewrote earlier text: not a delta
        deltas.append(renders[kind][len(head):])
    new = range(first + opens_with_turn, len(items))
    slots = tuple(j for j, i in enumerate(new) if not items[i][2])
    texts = _split(deltas[0], [_probe_content(0, new[j], items[new[j]]) for j in slots])
    if texts is None:
        return None
    frame = Frame(texts, slots)
    return frame if frame.render([_probe_content(1, i, items[i]) for i in new]) == deltas[1] else None


def _split(text: str, markers: list[str]) -> tuple[str, ...] | None:
    """The texts between the markers, in order; None if one is missing or any other content shows."""
    texts = []
    for marker in markers:
        head, found, text = text.partition(marker)
        if not found:
            return None
        texts.append(head)
    texts.append(text)
    if any(_MARK_OPEN in t or _MARK_CLOSE in t for t in texts):
        return None  # a content is missing, repeated or moved: its text is not fixed
    return tuple(texts)


# ----- 3. per-tokenizer registries ------------------------------------------------------------------

_FRAMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ENCODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def frames_for(tokenizer: Any, tools: list[dict] | None, end_of_turn_id: int | None) -> TemplateFrames | None:
    """The shared TemplateFrames for this tokenizer's current template, tools and special tokens, or None
    when the fast path cannot be vouched for (see the module docstring)."""
    key = _frames_key(tokenizer, tools, end_of_turn_id)
    if key is None:
        return None
    try:
        per_tokenizer = _FRAMES.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable
        return None
    if key not in per_tokenizer:
        per_tokenizer[key] = _new_frames(tokenizer, tools, end_of_turn_id, key[0])
    return per_tokenizer[key]


def _frames_key(tokenizer: Any, tools: list[dict] | None, end_of_turn_id: int | None) -> tuple | None:
    """Everything a rendering depends on besides the messages; None if the fast path is not for it."""
    if end_of_turn_id is None or not _renders_with_base_template(type(tokenizer)):
        return None
    try:
        template = tokenizer.get_chat_template(None, tools)
        tools_json = "null" if tools is None else json.dumps(tools)  # key order kept: tojson renders it
        special = repr(sorted(tokenizer.special_tokens_map.items()))
    except (TypeError, ValueError):
        return None
    return template, tools_json, special, len(tokenizer), end_of_turn_id


def _new_frames(tokenizer: Any, tools: list[dict] | None, end_of_turn_id: int, template: str) -> TemplateFrames | None:
    flow = analyse_template(template)
    if not flow.verbatim:
        return None
    end_of_turn_text = tokenizer.decode([end_of_turn_id], skip_special_tokens=False,
                                        clean_up_tokenization_spaces=False)
    return TemplateFrames(tokenizer, copy.deepcopy(tools), end_of_turn_text, flow)


@lru_cache(maxsize=None)
def _renders_with_base_template(cls: type) -> bool:
    """The tokenizer class renders with transformers' own apply_chat_template, the code the analysis assumes."""
    try:
        from transformers import PreTrainedTokenizerBase
    except ImportError:
        return False
    return (issubclass(cls, PreTrainedTokenizerBase)
            and cls.apply_chat_template is PreTrainedTokenizerBase.apply_chat_template
            and cls.get_chat_template is PreTrainedTokenizerBase.get_chat_template)


# ----- 4. encoding ----------------------------------------------------------------------------------


class CachedEncoder:
    """`tokenizer.encode(text, add_special_tokens=False)` as an int64 array, memoised by text.

    The arrays are shared between callers and threads: read them, never modify them. (An array rather
    than a tuple because RolloutHandler appends it to its own int64 array, which is then one memory copy.)
    """

    def __init__(self, tokenizer: Any):
        self.fingerprint = _vocabulary_fingerprint(tokenizer)
        """What the ids depend on besides the text; a changed fingerprint needs a new encoder."""
        self._tokenizer = tokenizer
        self._backend = _direct_backend(tokenizer)
        self._batch_fast = getattr(self._backend, "encode_batch_fast", None)  # tokenizers >= 0.21
        self._cache: dict[str, array] = {}
        self._lock = threading.Lock()
        self._nonempty_ids = _ids_that_decode_to_text(tokenizer, self._backend)

    def decodes_to_empty(self, ids: Sequence[int], drop_last: bool) -> bool | None:
        """Whether `decode(ids[:-1] if drop_last else ids)` is '', when the ids alone tell (None: decode).

        A byte-level decoder turns each token into its bytes and the bytes into text, so ids that start
        with a token of non-empty text never decode to ''.
        """
        content_length = len(ids) - 1 if drop_last else len(ids)
        if content_length == 0:
            return True
        return False if ids[0] in self._nonempty_ids else None

    def __call__(self, text: str) -> array:
        ids = self._cache.get(text)
        if ids is not None:
            PATH_STATS["encode_cache_hit"] += 1
            return ids
        PATH_STATS["encode_cache_miss"] += 1
        ids = array("q", self._encode(text))
        if len(text) <= MAX_CACHED_TEXT_CHARS:
            with self._lock:
                if len(self._cache) >= MAX_CACHED_TEXTS:
                    self._cache.pop(next(iter(self._cache)))  # oldest first
                self._cache[text] = ids
        return ids

    def _encode(self, text: str) -> list[int]:
        backend = self._backend
        # The direct call is the one transformers makes only while no truncation/padding is set on the
        # backend and special tokens are split the same way; otherwise let transformers set them up.
        if (backend is not None and backend.truncation is None and backend.padding is None
                and backend.encode_special_tokens == self._tokenizer.split_special_tokens):
            if self._batch_fast is not None:
                # Same ids as `encode` (only the character offsets are skipped), and the batch call lets
                # other dataflow threads run while Rust tokenizes (it releases the GIL; `encode` does not).
                return self._batch_fast([text], add_special_tokens=False)[0].ids
            return backend.encode(text, add_special_tokens=False).ids
        return self._tokenizer.encode(text, add_special_tokens=False)


def encoder_for(tokenizer: Any) -> CachedEncoder:
    """The shared CachedEncoder of this tokenizer (a new one if its vocabulary changed)."""
    encoder = _ENCODERS.get(tokenizer)
    if encoder is None or encoder.fingerprint != _vocabulary_fingerprint(tokenizer):
        encoder = CachedEncoder(tokenizer)
        _ENCODERS[tokenizer] = encoder
    return encoder


def _vocabulary_fingerprint(tokenizer: Any) -> tuple:
    # Adding tokens changes len(); split_special_tokens changes how special-token text is encoded.
    return len(tokenizer), getattr(tokenizer, "split_special_tokens", None)


def _ids_that_decode_to_text(tokenizer: Any, backend: Any) -> frozenset[int]:
    """Ids whose token alone decodes to non-empty text, if the decoder is byte-level (else none)."""
    try:
        from transformers import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
        from tokenizers.decoders import ByteLevel
    except ImportError:
        return frozenset()
    cls = type(tokenizer)
    if (backend is None or not isinstance(backend.decoder, ByteLevel)
            or cls.decode is not PreTrainedTokenizerBase.decode or cls._decode is not TokenizersBackend._decode):
        return frozenset()
    return frozenset(i for token, i in backend.get_vocab(with_added_tokens=True).items() if token)


def _direct_backend(tokenizer: Any) -> Any:
    """The Rust tokenizer if `encode` reaches it with nothing in between, else None."""
    try:
        from transformers import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    cls = type(tokenizer)
    if not (isinstance(tokenizer, TokenizersBackend)
            and cls.encode is PreTrainedTokenizerBase.encode
            and cls._get_padding_truncation_strategies is PreTrainedTokenizerBase._get_padding_truncation_strategies
            and cls._encode_plus is TokenizersBackend._encode_plus):
        return None
    return tokenizer.backend_tokenizer
