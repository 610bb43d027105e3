"""Chat templates rendered in a child process with a time limit (:class:`TemplateRenderer`).

A chat template comes with the weights (``tokenizer_config.json``), so it is input from
whoever published the checkpoint. The jinja2 sandbox keeps it from touching Python objects,
but not from looping for hours (``{% for a in x %}{% for b in x %}...``): rendered on the
server's threads, one such template pinned every worker, every request hung and the server
ignored SIGINT and SIGTERM (issue 51). Here the template renders in a child process started
with ``spawn`` (it imports jinja2 alone, not torch); a render that takes longer than
``timeout_s`` kills the child, answers an error and the next render starts a new one. This
module imports nothing of the server, so the child starts in about a tenth of a second.
"""

from __future__ import annotations

import multiprocessing
import signal
import threading
import time

#: The longest a chat template may take to render one request (seconds); real templates
#: take milliseconds.
TEMPLATE_TIMEOUT_S = 10.0


def chat_environment():
    """The jinja2 sandbox chat templates render in, with the globals transformers'
    ``apply_chat_template`` gives them (chat_template_utils.py): ``raise_exception`` (what a
    template calls on messages it refuses) and ``strftime_now``."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: time.strftime(fmt, time.localtime()))
    return env


def _worker(conn, source: str) -> None:
    """The child: compile ``source`` once, then render each ``(messages, variables)``
    received, answering ``("ok", text)`` or ``("error", message)``; ends when the parent
    closes the pipe. Ctrl-C is the parent's to handle (it kills the child)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    template = chat_environment().from_string(source)
    while True:
        try:
            messages, variables = conn.recv()
        except (EOFError, OSError):
            return
        try:
            conn.send(("ok", template.render(messages=messages, **variables)))
        except Exception as e:   # a template that rejects these messages (roles out of order)
            conn.send(("error", f"{type(e).__name__}: {e}" if not str(e) else str(e)))


class TemplateTimeout(Exception):
    """The template did not finish rendering within the time limit."""


class TemplateRenderer:
    """Renders one chat template in a child process, one request at a time (renders take
    milliseconds; the lock orders them), each within ``timeout_s``.

    :meth:`render` raises :class:`TemplateTimeout` after ``timeout_s`` (the child is
    killed), :class:`ValueError` with the template's own message when it refuses the
    messages. The template's syntax is checked when the renderer is made (``jinja2``'s
    ``TemplateSyntaxError``), so a broken one stops the server at start, not per request."""

    def __init__(self, source: str, timeout_s: float | None = None):
        chat_environment().parse(source)   # syntax errors at start
        self.source, self.timeout_s = source, TEMPLATE_TIMEOUT_S if timeout_s is None else timeout_s
        self._lock = threading.Lock()
        self._proc = self._conn = None

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_worker, args=(child, self.source), daemon=True,
                                 name="parcompile-chat-template")
        self._proc.start()
        child.close()
        self._conn = parent

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(5)
            self._conn.close()
        self._proc = self._conn = None

    def render(self, messages: list[dict], **variables) -> str:
        """The template rendered on ``messages`` (``[{"role", "content"}]``) and
        ``variables`` (``add_generation_prompt``, special tokens), as text."""
        with self._lock:
            if self._proc is None or not self._proc.is_alive():
                self._kill()
                self._start()
            deadline = time.monotonic() + self.timeout_s
            try:
                self._conn.send((messages, variables))
                if not self._conn.poll(max(deadline - time.monotonic(), 0)):
                    self._kill()
                    raise TemplateTimeout(f"the chat template did not finish rendering in {self.timeout_s:g} s")
                status, value = self._conn.recv()
            except (EOFError, OSError, BrokenPipeError):   # the child died (killed from outside, out of memory)
                self._kill()
                raise TemplateTimeout("the chat template's renderer stopped") from None
        if status == "error":
            raise ValueError(value)
        return value

    def close(self) -> None:
        """Stop the child (it also ends with the server: a daemon process)."""
        with self._lock:
            self._kill()
