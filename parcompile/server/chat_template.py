"""Chat templates rendered in a child process with a time limit (:class:`TemplateRenderer`).

A chat template comes with the weights (``tokenizer_config.json``), so it is input from
whoever published the checkpoint. The jinja2 sandbox keeps it from touching Python objects,
but not from looping for hours (``{% for a in x %}{% for b in x %}...``): rendered on the
server's threads, one such template pinned every worker, every request hung and the server
ignored SIGINT and SIGTERM (issue 51). Here the template renders in a child Python that
runs this file alone (``python -c``, loading it by path: jinja2 and the standard library,
not torch, not the server, and not the parent's ``__main__``, which multiprocessing's
``spawn`` re-runs: a script that starts the server without an ``if __name__ ==
"__main__"`` guard started a second server in the child); requests and replies are JSON
lines on its stdin and stdout. A render that takes longer than ``timeout_s`` kills the
child, answers an error and the next render starts a new one (about a tenth of a second).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import weakref

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


def _child_main() -> None:
    """The child: the first line of stdin is ``[source, max_chars]`` (JSON); the template is
    compiled once, then each further line ``[messages, variables]`` is rendered and answered
    on stdout as ``["ok", text]`` or ``["error", message]`` (also for a text over
    ``max_chars``, which never reaches the server); ends at the end of stdin (the parent
    closed the pipe or died). Ctrl-C is the parent's to handle (it kills the child)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    source, max_chars = json.loads(sys.stdin.readline())
    template = chat_environment().from_string(source)
    for line in sys.stdin:
        messages, variables = json.loads(line)
        try:
            text = template.render(messages=messages, **variables)
            reply = ["ok", text] if max_chars is None or len(text) <= max_chars else \
                ["error", f"the rendered prompt has {len(text):,} characters, over the {max_chars:,} a request may "
                          "send"]
        except Exception as e:   # a template that rejects these messages (roles out of order)
            reply = ["error", f"{type(e).__name__}: {e}" if not str(e) else str(e)]
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


#: What the child runs: this file loaded by path (no package import), without the current
#: directory on sys.path (``-c`` puts it first).
_CHILD = ("import sys; del sys.path[0]; import importlib.util as u; "
          "s = u.spec_from_file_location('parcompile_chat_template_child', sys.argv[1]); "
          "m = u.module_from_spec(s); s.loader.exec_module(m); m._child_main()")


class TemplateTimeout(Exception):
    """The template did not finish rendering within the time limit."""


class TemplateRenderer:
    """Renders one chat template in a child process, one request at a time (renders take
    milliseconds; the lock orders them), each within ``timeout_s``.

    :meth:`render` raises :class:`TemplateTimeout` after ``timeout_s`` (the child is
    killed), :class:`ValueError` with the template's own message when it refuses the
    messages, or when its text is over ``max_chars`` characters (None: no bound; a template
    can render gigabytes in its time, ``{{ "x" * 10**9 }}``). The template's syntax is checked when the renderer is made (``jinja2``'s
    ``TemplateSyntaxError``), so a broken one stops the server at start, not per request."""

    def __init__(self, source: str, timeout_s: float | None = None, max_chars: int | None = None):
        chat_environment().parse(source)   # syntax errors at start
        self.source, self.timeout_s = source, TEMPLATE_TIMEOUT_S if timeout_s is None else timeout_s
        self.max_chars = max_chars
        self._lock = threading.Lock()
        self._proc = None

    def _start(self) -> None:
        self._proc = subprocess.Popen([sys.executable, "-c", _CHILD, os.path.abspath(__file__)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        self._stop = weakref.finalize(self, self._proc.kill)   # also when the server exits
        self._send([self.source, self.max_chars])

    def _send(self, value) -> None:
        self._proc.stdin.write(json.dumps(value).encode() + b"\n")
        self._proc.stdin.flush()

    def _reply(self, deadline: float) -> list:
        """The child's next line, read before ``deadline`` (time.monotonic()). Raises
        TemplateTimeout past it, EOFError when the child ended."""
        fd, parts = self._proc.stdout.fileno(), []
        while not parts or not parts[-1].endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TemplateTimeout(f"the chat template did not finish rendering in {self.timeout_s:g} s")
            part = os.read(fd, 1 << 20)
            if not part:
                raise EOFError
            parts.append(part)
        return json.loads(b"".join(parts))

    def _kill(self) -> None:
        if self._proc is not None:
            self._stop()                          # kills the child
            self._proc.wait(5)
            self._proc.stdin.close()
            self._proc.stdout.close()
        self._proc = None

    def render(self, messages: list[dict], **variables) -> str:
        """The template rendered on ``messages`` (``[{"role", "content"}]``) and
        ``variables`` (``add_generation_prompt``, special tokens), as text; both must be
        JSON (they come from a request and tokenizer_config.json)."""
        with self._lock:
            try:
                if self._proc is None or self._proc.poll() is not None:
                    self._kill()
                    self._start()
                self._send([messages, variables])
                status, value = self._reply(time.monotonic() + self.timeout_s)
            except TemplateTimeout:
                self._kill()
                raise
            except (EOFError, OSError, ValueError):   # the child died (killed from outside, out of memory)
                self._kill()
                raise TemplateTimeout("the chat template's renderer stopped") from None
        if status == "error":
            raise ValueError(value)
        return value

    def close(self) -> None:
        """Stop the child (it is also killed when the server exits)."""
        with self._lock:
            self._kill()
