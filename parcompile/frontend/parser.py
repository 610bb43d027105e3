"""Parse `.par` text into the AST (:mod:`parcompile.frontend.ast`).

The grammar is ``grammar/par.lark`` at the top of the repository, parsed with lark's
LALR parser and contextual lexer, positions propagated. A syntax error never surfaces as
a lark exception: it becomes one :class:`~parcompile.diagnostics.Diagnostic` in the
user's words (``expected `=` after key `tp```, ``unterminated string``,
``unexpected `}```) and :func:`parse` raises :class:`~parcompile.diagnostics.SpecError`.
Parsing stops at the first syntax error; every later check needs a tree.
"""

from __future__ import annotations

import re
import unicodedata
from functools import lru_cache
from pathlib import Path

from lark import Lark, Token, Tree
from lark.exceptions import LarkError, UnexpectedCharacters, UnexpectedInput, UnexpectedToken

from parcompile.diagnostics import Diagnostic, Span, SpecError
from parcompile.frontend import ast

#: Where the reference grammar lives (the package is installed editable).
# grammar/par.lark at the top of the repository is the language's reference;
# parcompile/grammar links to it so that wheels carry it as package data
GRAMMAR_PATH = Path(__file__).resolve().parent.parent / "grammar" / "par.lark"   # parcompile/grammar

#: Deepest nesting of lists accepted (keeps the tree walk far from Python's recursion limit).
MAX_LIST_DEPTH = 16
#: Most items one list may hold, and all lists of a spec together: a spec's longest lists
#: have one item per layer or stage (hundreds); 300,000 items took a minute to check.
MAX_LIST_ITEMS = 4096
MAX_SPEC_LIST_ITEMS = 65536
#: Longest integer literal accepted, in digits (Python refuses to convert very long ones).
MAX_INT_DIGITS = 100

BLOCK_KINDS = ("model", "cluster", "parallel", "train", "serve")

#: Digits, optionally grouped by single underscores (`128_256`).
_DIGIT_GROUPS = re.compile(r"[0-9]+(_[0-9]+)*")

_ESCAPES = {'"': '"', "\\": "\\", "n": "\n", "t": "\t", "r": "\r"}
_ESCAPE = re.compile(r"\\(.)", re.S)

# How the parser's terminals are named in messages.
_TERMINAL_WORDS = {
    "WORD": "a name",
    "DIGIT_WORD": "a name",
    "INT": "an integer",
    "FLOAT": "a number",
    "UNIT": "a unit",
    "STRING": "a string",
    "_NL": "a newline",
    "LBRACE": "`{`",
    "RBRACE": "`}`",
    "LSQB": "`[`",
    "RSQB": "`]`",
    "EQUAL": "`=`",
    "COMMA": "`,`",
    "FROM": "`from`",
    "$END": "the end of the file",
}
_VALUE_HELP = (
    "a value is a number, a quantity such as `80 GiB`, `true` or `false`, a word, "
    'a "string" or a [list]'
)
_BLOCK_HELP = 'a block is `KIND NAME [from "SOURCE"] { key = value ... }` (`parallel`, `train` and `serve`: `KIND { ... }`)'


@lru_cache(maxsize=1)
def _parser() -> Lark:
    return Lark(
        GRAMMAR_PATH.read_text(encoding="utf-8"),
        parser="lalr",
        lexer="contextual",
        propagate_positions=True,
        maybe_placeholders=False,
    )


def strip_bom(text: str) -> str:
    """``text`` without a leading UTF-8 byte order mark (U+FEFF), which some Windows
    editors write; it is invisible, so a column counted with it would be one off."""
    return text[1:] if text.startswith("\ufeff") else text


def source_text(text: str) -> str:
    """``text`` as the parser and the diagnostics read it: without a leading byte order mark
    (:func:`strip_bom`) and with each lone carriage return (classic Mac OS line ends) read as
    a newline, as Python's universal newlines read it (same length: columns do not move)."""
    text = strip_bom(text)
    return re.sub(r"\r(?!\n)", "\n", text) if "\r" in text else text


def parse(text: str, filename: str = "<spec>") -> ast.Spec:
    """Parse spec ``text`` into an :class:`ast.Spec`; ``filename`` is used in spans.

    Raises :class:`SpecError` with one diagnostic at the first syntax error, or with
    one per malformed literal (an integer too long to be meant, a misplaced `_`, a
    leading zero). A UTF-8 byte order mark at the start is dropped (:func:`strip_bom`), so
    columns count from the first character a user sees.
    """
    text = source_text(text)
    ctx = _Context(filename, text)
    interactive = _parser().parse_interactive(text)
    try:
        for token in interactive.lexer_thread.lex(interactive.parser_state):
            interactive.feed_token(token)
            ctx.feed(token)  # after the parser took it: ctx describes what was accepted
        tree = interactive.feed_eof(ctx.prev)
    except _TooDeep as e:
        raise SpecError([e.diagnostic], text) from None
    except UnexpectedInput as e:
        raise SpecError([ctx.explain(e)], text) from None
    except LarkError as e:  # pragma: no cover - lark's other errors are grammar bugs
        raise SpecError([Diagnostic("error", f"cannot parse: {e}", Span.unknown(filename))], text) from None
    return _Builder(filename, text).spec(tree)


# --------------------------------------------------------------------------------------
# Syntax errors in the user's words


class _TooDeep(Exception):
    """Parsing stops here: lists nested too deep or too long (the diagnostic says which)."""

    def __init__(self, diagnostic: Diagnostic):
        self.diagnostic = diagnostic


class _Context:
    """Tracks where the parser is (which block, key, open brackets) from the tokens fed."""

    def __init__(self, filename: str, text: str):
        self.filename = filename
        self.text = text
        self.prev: Token | None = None
        self.kind: Token | None = None      # kind word of the block being read
        self.brace: Token | None = None     # its `{`, once seen
        self.key: Token | None = None       # key of the entry being read
        self.lists: list[Token] = []        # open `[`
        self.counts: list[int] = []         # items (commas) read in each open list
        self.items = 0                      # list items read so far in the whole spec

    def feed(self, tok: Token) -> None:
        t = tok.type
        if t == "WORD" and self.kind is None:
            self.kind = tok
        elif t == "LBRACE":
            self.brace = tok
        elif t == "RBRACE":
            self.kind = self.brace = self.key = None
        elif t == "LSQB":
            self.lists.append(tok)
            self.counts.append(0)
            if len(self.lists) > MAX_LIST_DEPTH:
                raise _TooDeep(Diagnostic(
                    "error", f"lists nested more than {MAX_LIST_DEPTH} deep", self.span(tok),
                    help="values are flat lists such as `[8, 8, 7, 7]`"))
        elif t == "RSQB" and self.lists:
            self.lists.pop()
            self.counts.pop()
        elif t == "COMMA" and self.lists:
            self.items += 1
            self.counts[-1] += 1
            if self.counts[-1] >= MAX_LIST_ITEMS or self.items >= MAX_SPEC_LIST_ITEMS:
                one = self.counts[-1] >= MAX_LIST_ITEMS
                limit, where = (MAX_LIST_ITEMS, "one list") if one else (MAX_SPEC_LIST_ITEMS, "the lists of a spec")
                raise _TooDeep(Diagnostic(
                    "error", f"more than {limit:,} items in {where}", self.span(self.lists[-1]),
                    help="a spec's lists hold one value per layer or stage; give the value once"))
        elif (t == "WORD" and self.brace is not None and not self.lists
              and self.prev is not None and self.prev.type in ("LBRACE", "_NL", "COMMA")):
            self.key = tok
        self.prev = tok

    # -- spans and words ---------------------------------------------------------------

    def span(self, tok: Token) -> Span:
        if tok.type == "$END":
            return self.eof_span()
        return Span(self.filename, tok.line, tok.column, tok.end_line, tok.end_column)

    def eof_span(self) -> Span:
        lines = self.text.split("\n")
        return Span(self.filename, len(lines), len(lines[-1]) + 1)

    @staticmethod
    def describe(tok: Token) -> str:
        if tok.type == "_NL":
            return "the end of the line"
        if tok.type == "$END":
            return "the end of the file"
        if tok.type == "STRING":
            return f"the string {tok}"
        return f"`{tok}`"

    def _kind_words(self) -> str:
        return f"`{self.kind}`" if self.kind is not None else "the"

    # -- the messages ------------------------------------------------------------------

    def explain(self, e: UnexpectedInput) -> Diagnostic:
        """Rewrite a lark error into one diagnostic (message, span, help)."""
        if isinstance(e, UnexpectedCharacters):
            return self._bad_character(e)
        assert isinstance(e, UnexpectedToken)
        message, tok, help = self._bad_token(e.token, set(e.expected))
        return Diagnostic("error", message, self.span(tok), help)

    def _bad_character(self, e: UnexpectedCharacters) -> Diagnostic:
        line, col = e.line, e.column
        if e.char == '"':
            line_text = self.text.split("\n")[line - 1]
            span = Span(self.filename, line, col, line, len(line_text.rstrip("\r")) + 1)
            return Diagnostic("error", "unterminated string", span,
                              help='close the string with `"` on the same line')
        shown = e.char if e.char.isprintable() else repr(e.char)
        span = Span(self.filename, line, col, line, col + 1)
        if _is_word_char(e.char):
            return self._bad_word_character(e, shown, span)
        if self.prev is not None and self.prev.type == "EQUAL":
            return Diagnostic("error", f"expected a value after `{self.key} =`, found `{shown}`",
                              span, help=_VALUE_HELP)
        if self.prev is not None and self.prev is self.key:
            return Diagnostic("error", f"expected `=` after key `{self.key}`, found `{shown}`", span)
        return Diagnostic("error", f"unexpected character `{shown}`", span,
                          help="keys and names are lower_snake_case words; strings go in double quotes")

    def _bad_word_character(self, e: UnexpectedCharacters, shown: str, span: Span) -> Diagnostic:
        """A letter outside ASCII (``läyers``, ``modèle``): name the whole word it spoils
        and what it is (key, name, value), with an ASCII spelling when one is obvious."""
        pos = e.pos_in_stream
        prev = self.prev
        if unicodedata.decimal(self.text[pos], None) is not None:
            return self._non_ascii_digit(pos, span)
        glued = prev is not None and prev.type in ("WORD", "DIGIT_WORD") and prev.end_pos == pos
        start = prev.start_pos if glued else pos
        end = pos
        while end < len(self.text) and (self.text[end].isalnum() or _is_word_char(self.text[end])
                                        or self.text[end] in "_.-"):
            end += 1
        word = self.text[start:end]
        in_value = bool(self.lists) or (prev is not None and prev.type == "EQUAL") or \
            (glued and self.brace is not None and self.key is not None and prev is not self.key)
        if in_value:
            what, rule = "value", "bare-word values are ASCII; put other text in double quotes"
        elif self.brace is not None:
            what, rule = "key", "keys are lower_snake_case ASCII words (letters a-z, digits and `_`)"
        else:
            what, rule = "name", "block kinds and names are ASCII words (letters, digits, `_`, `.` and `-`)"
        ascii_word = unicodedata.normalize("NFKD", word).encode("ascii", "ignore").decode()
        fix = f"write `{ascii_word.lower() if what == 'key' else ascii_word}`; " \
            if ascii_word and len(ascii_word) == len(word) else ""
        return Diagnostic("error", f"invalid character `{shown}` in {what} `{word}`", span, help=fix + rule)

    def _non_ascii_digit(self, pos: int, span: Span) -> Diagnostic:
        """A decimal digit outside ASCII (``1٠``, ``３``): Python's ``int`` would read it as a
        number, but a spec's numbers are ASCII so that what a reader sees is what is planned;
        the help spells the whole number in ASCII digits."""
        start, end = pos, pos
        while start > 0 and unicodedata.decimal(self.text[start - 1], None) is not None:
            start -= 1
        while end < len(self.text) and unicodedata.decimal(self.text[end], None) is not None:
            end += 1
        number = self.text[start:end]
        c = self.text[pos]
        ascii_number = "".join(str(unicodedata.decimal(d)) for d in number)
        return Diagnostic("error", f"`{c}` ({unicodedata.name(c, 'a digit')}) is not an ASCII digit", span,
                          help=f"numbers are written with the digits 0-9: write `{ascii_number}`")

    def _bad_token(self, tok: Token, expected: set[str]) -> tuple[str, Token, str | None]:
        prev = self.prev
        prev_type = prev.type if prev is not None else None
        found = self.describe(tok)
        if prev_type == "EQUAL":
            return f"expected a value after `{self.key} =`, found {found}", tok, _VALUE_HELP
        if tok.type == "EQUAL" and prev_type == "UNIT":
            return (f"missing `,` or newline before `{prev}`", prev,
                    "write one `key = value` per line, or separate entries with `,`")
        if tok.type == "$END" and self.lists:
            return "unclosed `[`", self.lists[-1], "close the list with `]`"
        if tok.type == "$END" and self.brace is not None:
            return (f"the {self._kind_words()} block is not closed", self.brace,
                    "add `}` after its last entry")
        if (self.brace is not None and prev is not None and prev is self.key and "EQUAL" in expected
                and (tok.type in ("LBRACE", "FROM") or prev in BLOCK_KINDS)):
            # `cluster local from "cpu" {` read as a key: the block before it lacks its `}`
            return (f"the {self._kind_words()} block is not closed", self.brace,
                    f"add `}}` after its last entry, before `{prev}` on line {prev.line}, which starts another block")
        if self.brace is None and self.kind is not None:
            if tok.type == "EQUAL" and prev is self.kind:
                return (f"`{self.kind} = ...` is outside of any block", self.kind,
                        "entries go inside a block, e.g. `parallel { tp = 8 }`")
            if "LBRACE" in expected:
                return (f"expected `{{` to open the {self._kind_words()} block, found {found}", tok,
                        _BLOCK_HELP)
        if "EQUAL" in expected:
            return f"expected `=` after key `{prev}`, found {found}", tok, None
        if self.lists:
            return (f"expected `,` or `]` in the list, found {found}", tok,
                    "list items are separated by `,`: `[8, 8, 7, 7]`")
        if self.brace is not None and self.key is not None and "_NL" in expected and "WORD" not in expected:
            return (f"expected a newline or `,` after the value of `{self.key}`, found {found}", tok,
                    "write one `key = value` per line, or separate entries with `,`")
        if self.brace is not None and "WORD" in expected:
            return f"expected a key, found {found}", tok, "an entry is `key = value`"
        if tok.type == "RBRACE":
            return "unexpected `}`", tok, "no block is open here"
        if self.brace is None and self.kind is None:
            return (f"expected a block, found {found}", tok,
                    _BLOCK_HELP + f"; blocks are {', '.join(BLOCK_KINDS)}")
        words = sorted({_TERMINAL_WORDS.get(t, t) for t in expected})
        return f"unexpected {found}", tok, "expected " + " or ".join(words)


def _is_word_char(c: str) -> bool:
    """A letter or digit outside ASCII, which no `.par` word may hold (``ä``, ``é``, ``٣``)."""
    return not c.isascii() and (c.isalnum() or unicodedata.category(c).startswith("M"))


# --------------------------------------------------------------------------------------
# Tree -> AST


class _Builder:
    """Turns lark's tree into :mod:`ast` nodes, with spans and decoded literals."""

    def __init__(self, filename: str, text: str):
        self.filename = filename
        self.text = text
        self.errors: list[Diagnostic] = []

    def spec(self, tree: Tree) -> ast.Spec:
        blocks = tuple(self.block(b) for b in tree.children)
        if self.errors:
            raise SpecError(self.errors, self.text)
        return ast.Spec(blocks, self.filename, self.text)

    def _span_tok(self, tok: Token) -> Span:
        return Span(self.filename, tok.line, tok.column, tok.end_line, tok.end_column)

    def _span_tree(self, tree: Tree) -> Span:
        m = tree.meta
        return Span(self.filename, m.line, m.column, m.end_line, m.end_column)

    def _text(self, node: Token | Tree) -> str:
        if isinstance(node, Token):
            return str(node)
        return self.text[node.meta.start_pos:node.meta.end_pos]

    def block(self, tree: Tree) -> ast.Block:
        header, *entries = tree.children
        kind, *rest = header.children
        name = source = name_span = source_span = None
        for part in rest:
            if part.data == "name":
                tok = part.children[0]
                name, name_span = str(tok), self._span_tok(tok)
            else:
                tok = part.children[0]
                source, source_span = self._string(tok), self._span_tok(tok)
        return ast.Block(
            kind=str(kind),
            name=name,
            source=source,
            entries=tuple(self.entry(e) for e in entries),
            span=self._span_tree(header),
            name_span=name_span,
            source_span=source_span,
        )

    def entry(self, tree: Tree) -> ast.Entry:
        key, value = tree.children
        v = self.value(value)
        return ast.Entry(str(key), v, self._span_tok(key), v.span)

    def value(self, tree: Tree) -> ast.Value:
        kind = tree.data
        span, text = self._span_tree(tree), self._text(tree)
        if kind == "list":
            return ast.List(tuple(self.value(c) for c in tree.children), text, span)
        if kind == "quantity":
            number_tok, unit_tok = tree.children
            number = self._number(number_tok)
            return ast.Quantity(number, str(unit_tok), self._span_tok(unit_tok), text, span)
        tok = tree.children[0]
        if kind in ("int", "float"):
            return self._number(tok)
        if kind == "string":
            return ast.String(self._string(tok), text, span)
        if text in ("true", "false"):
            return ast.Bool(text == "true", text, span)
        return ast.Word(text, text, span)

    def _number(self, tok: Token) -> ast.Int | ast.Float:
        text, span = str(tok), self._span_tok(tok)
        digits = text.replace("_", "")
        self._check_digits(text, tok.type == "FLOAT", span)
        if tok.type == "FLOAT":
            return ast.Float(float(digits), text, span)
        if len(digits.lstrip("+-")) > MAX_INT_DIGITS:
            self.errors.append(Diagnostic("error", f"integer literal of {len(digits)} digits is too long", span))
            return ast.Int(0, text, span)
        return ast.Int(int(digits), text, span)

    def _check_digits(self, text: str, is_float: bool, span: Span) -> None:
        """Report `_` that does not sit between two digits (``2__56``, ``256_``) and, in an
        integer, a leading zero (``0256``: C and Python 2 read it as octal, Python 3 refuses it)."""
        body = text.lstrip("+-")
        sign = text[:len(text) - len(body)]
        mantissa = re.split(r"[eE]", body)[0]
        for run in re.split(r"\.", mantissa):
            if run and not _DIGIT_GROUPS.fullmatch(run):
                fixed = sign + body.replace("_", "")
                self.errors.append(Diagnostic(
                    "error", f"misplaced `_` in the number `{text}`", span,
                    help=f"`_` goes between two digits, one at a time (`128_256`); write `{fixed}`"))
                return
        if not is_float and len(body.replace("_", "")) > 1 and body.startswith("0"):
            value = sign + (body.replace("_", "").lstrip("0") or "0")
            self.errors.append(Diagnostic(
                "error", f"integer `{text}` has a leading zero", span,
                help=f"write `{value}`",
                note="`.par` has no octal or zero-padded integers; a leading zero is most likely a typo"))

    @staticmethod
    def _string(tok: Token) -> str:
        """The value of a STRING token: quotes dropped, ``\\"``, ``\\\\``, ``\\n``, ``\\t``,
        ``\\r`` decoded, any other escape kept as written; one regular-expression pass (linear
        and fast on a string of megabytes)."""
        return _ESCAPE.sub(lambda m: _ESCAPES.get(m.group(1), m.group(0)), str(tok)[1:-1])
