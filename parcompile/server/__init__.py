"""`parcompile serve`: the compiled serve program as an OpenAI-compatible HTTP server
(SPEC 4).

One front process (this one) runs the FastAPI application on uvicorn (:mod:`.api`) and
launches the serve program under torchrun on the plan's ranks (:mod:`.engines`); each
data-parallel replica's leader rank runs the continuous-batching engine
(:mod:`parcompile.runtime.serve.paged`) and broadcasts every step to the other tp x pp ranks of
its replica. vLLM splits its OpenAI server the same way (an API process, engine-core
processes). When a rank dies the front answers 503 for :data:`FAIL_GRACE_S` seconds and
exits with status 1.
"""

from __future__ import annotations

import socket
import sys
import threading
from pathlib import Path

from parcompile.core.files import json_loads

#: seconds the front keeps answering 503 after the engines failed, before it exits
FAIL_GRACE_S = 3.0



def base_url(host: str, port: int) -> str:
    """The OpenAI base URL a client uses for ``host``:``port``: an IPv6 address in brackets
    (RFC 3986 section 3.2.2: ``http://[::1]:8000/v1``), a name or IPv4 address as it is."""
    shown = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"http://{shown}:{port}/v1"

def _chat_template(weights: str | None) -> tuple[str | None, dict]:
    """The weights' chat template (``tokenizer_config.json``: ``chat_template``, a string or
    a list of named ones, "default" first) and its special tokens (bos_token, eos_token)."""
    if not weights:
        return None, {}
    f = Path(weights) / "tokenizer_config.json"
    try:
        cfg = json_loads(f.read_text()) if f.is_file() else {}
    except (OSError, ValueError):
        return None, {}
    tpl = cfg.get("chat_template")
    if isinstance(tpl, list):
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default") or next(iter(named.values()), None)
    special = {}
    for k in ("bos_token", "eos_token"):
        v = cfg.get(k)
        special[k] = v.get("content", "") if isinstance(v, dict) else (v or "")
    return (tpl if isinstance(tpl, str) else None), special


def model_info(plan) -> "api.ModelInfo":
    """What the API needs from the plan: name, vocabulary, context, default sampling, end
    tokens, tokenizer and chat template (module :mod:`.api`)."""
    from parcompile.runtime.serve import generate as gen
    from parcompile.server import api

    cfg = plan.config
    sv = cfg.serve
    weights = sv.weights
    tpl, special = _chat_template(weights)
    return api.ModelInfo(name=cfg.model.name, vocab=cfg.model.vocab, context=sv.prompt_len + sv.max_new_tokens,
        temperature=sv.temperature, top_k=sv.top_k, eos=gen.end_tokens(weights),
        tokenizer=gen.load_tokenizer(None, weights, cfg.model.vocab),
        chat_template=tpl or api.PLAIN_CHAT_TEMPLATE, special=special,
        max_seqs=plan.data["serve"]["batch_per_replica"])


def port_free(host: str, port: int) -> str | None:
    """None when ``host:port`` can be bound, else why not (a port outside 1-65535, a host
    that does not resolve, an address in use, an empty host: the socket would bind every interface)."""
    if not 1 <= port <= 65535:
        return f"the port must be 1-65535, got {port}"
    if not host.strip():
        return "the host is empty: give an address, 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)"
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except (OSError, OverflowError) as e:
            return str(e)
    return None


#: the environment variable `serve` reads the API key from when --api-key is not given
API_KEY_ENV = "PARCOMPILE_API_KEY"


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) only listens on this machine's loopback."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        try:
            return all(ipaddress.ip_address(a[4][0]).is_loopback for a in socket.getaddrinfo(host, None))
        except (OSError, ValueError):
            return False


def run_server(plan, program: Path, host: str = "127.0.0.1", port: int = 8000, log=print,
               api_key: str | None = None, max_body: int | None = None) -> int:
    """Launch ``program`` (the compiled serve.py of ``plan``) and answer HTTP on
    ``host:port`` until interrupted; returns the exit status (1 when a rank died).

    ``api_key``: requests to /v1 without ``Authorization: Bearer KEY`` get 401 (None: open;
    a warning when ``host`` is not a loopback address); ``max_body``: the request body
    limit in bytes (None: :func:`parcompile.server.api.default_max_body` of the context)."""
    import uvicorn

    from parcompile.server.api import build_app, default_max_body
    from parcompile.server.engines import EngineFailed, Engines
    from parcompile.server.http import uvicorn_config
    from parcompile.server.metrics import Metrics

    info = model_info(plan)
    why = port_free(host, port)
    if why:
        print(f"error: cannot listen on {host}:{port}: {why}", file=sys.stderr)
        return 1
    if not api_key and not is_loopback(host):
        print(f"warning: serving on {host}, which is not a loopback address, without an API key: anyone who can reach "
              f"it can use the model; set --api-key KEY (or {API_KEY_ENV})", file=sys.stderr, flush=True)
    max_body = default_max_body(info.context) if max_body is None else max_body
    d = plan.data
    log(f"starting {d['world_size']} rank(s): dp {d['degrees']['dp']} x tp {d['degrees']['tp']} x pp "
        f"{d['degrees']['pp']}; KV cache {d['serve']['kv_blocks']} blocks of {d['serve']['block_size']} tokens "
        f"per replica, at most {d['serve']['batch_per_replica']} sequences decoded at once", flush=True)
    if not plan.config.serve.weights:
        log(f"note: the `serve` block has no `weights`: the model answers with random weights (seed "
            f"{plan.config.serve.seed}); train with `checkpoint_dir` and set `weights` to it, or give a Hugging Face "
            f"checkpoint directory", flush=True)

    from parcompile.jobs import Terminated, sigterm_interrupts

    # SIGTERM as Ctrl-C (parcompile.jobs, as for `run`): while the ranks start, and when
    # uvicorn, having shut down gracefully on it, raises it again (its default action would
    # kill this process before the ranks are told to stop: they would see EOF and fail)
    with sigterm_interrupts():
        try:
            # (serve.compile: the ranks compile and warm up before they are ready, minutes on a CPU)
            engines = Engines(program, d["world_size"], d["degrees"]["dp"],
                              startup_timeout_s=1800.0 if d.get("serve", {}).get("compile") else 600.0)
        except EngineFailed as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt as e:   # Engines has ended the ranks it started
            name = "SIGTERM" if isinstance(e, Terminated) else "SIGINT"
            print(f"interrupted ({name}) while the ranks started: stopped torchrun and its {d['world_size']} "
                  f"rank(s)", file=sys.stderr, flush=True)
            return 143 if name == "SIGTERM" else 130    # as a shell reports them, and as `run` does
        try:    # from here on the ranks are told to stop, whatever interrupts
            app = build_app(info, engines, Metrics(info.name), api_key=api_key, max_body=max_body)
            server = uvicorn.Server(uvicorn_config(app, host, port))

            def on_fail(reason: str) -> None:
                print(f"error: {reason}; answering 503 for {FAIL_GRACE_S:.0f} s, then exiting", file=sys.stderr,
                      flush=True)
                threading.Timer(FAIL_GRACE_S, lambda: setattr(server, "should_exit", True)).start()

            engines.on_fail = on_fail
            if engines.failed:
                on_fail(engines.failed)
            log(f"serving `{info.name}` on {base_url(host, port)} (OpenAI API; "
                f"{'API key required' if api_key else 'no API key'}; bodies up to {max_body:,} bytes; Ctrl-C stops)",
                flush=True)
            server.run()
        except KeyboardInterrupt:        # Ctrl-C or SIGTERM, re-raised by uvicorn after its shutdown
            pass
        finally:
            status = engines.stop()
    if engines.failed:
        return 1
    return 0 if status in (0, None) else 1

__all__ = ["run_server", "model_info", "port_free", "is_loopback", "FAIL_GRACE_S", "API_KEY_ENV"]
