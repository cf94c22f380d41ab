"""`rlhf serve-reward`: a reward model behind HTTP (stdlib server, 127.0.0.1 by default).

POST /score  {"prompts": [...], "responses": [...], "labels": [...], "token_ids": [[...], ...], "prompt_lens": [...]}
          -> {"rewards": [...]}
POST /get_reward  OpenRLHF's remote reward protocol: {"query": [prompt + response, ...], "prompts": [...]}
          -> {"rewards": [...], "scores": [...], "extra_logs": {}}
GET  /health -> {"status": "ok", "auth": "bearer"}  (+ "model": PATH with the token)

Both POSTs need `Authorization: Bearer TOKEN` (401 + `WWW-Authenticate: Bearer` otherwise): the
token is made at the first start (`secrets.token_urlsafe(32)`) and kept in a 0600 file (directory
0700; default `.rlhf/reward-server.token`), reused by later starts; the rl stage reads it with
`rl.reward.token_file=PATH`.  It is never logged.  `--no-auth` turns this off (with a warning).

With `token_ids` the model scores exactly those ids (token in, token out); without them it
tokenizes prompt + response (for /get_reward: the query, split after its prompt where the prompt
is given and begins it, so both paths tokenize a sample alike).  Binding anywhere but loopback is the user's explicit choice: the
token travels in plain HTTP, so put a TLS-terminating proxy in front before exposing it.
"""
from __future__ import annotations

import hmac
import json
import logging
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from rlhf_core.atomic import secret_file
from rlhf_core.models.load import load_tokenizer

log = logging.getLogger("rlhf.reward_server")

DEFAULT_TOKEN_FILE = ".rlhf/reward-server.token"
MAX_DRAIN = 64 << 20  # an unauthorised request's body read (and dropped) so its client sees the 401


UNAUTHORIZED = {"error": "unauthorized: send `Authorization: Bearer TOKEN`, TOKEN being the content of the server's token file "
                         "(rl stage: rl.reward.token_file=PATH)"}


def authorized(headers, expected: bytes | None) -> bool:
    """Whether the request's `Authorization: Bearer ...` is `expected` (None: no auth), compared in
    constant time."""
    if expected is None:
        return True
    scheme, _, given = (headers.get("Authorization") or "").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode("utf-8", "replace"), expected)


def drain(handler: BaseHTTPRequestHandler) -> None:
    """Read and drop a refused request's body (up to MAX_DRAIN)."""
    try:
        left = min(int(handler.headers.get("Content-Length") or 0), MAX_DRAIN)
    except ValueError:
        left = 0
    while left > 0 and (chunk := handler.rfile.read(min(left, 1 << 16))):
        left -= len(chunk)


def make_server(model_path: str, host: str = "127.0.0.1", port: int = 8765, max_batch: int = 512, *,
                token: str | None) -> ThreadingHTTPServer:
    """`token`: the bearer token both POSTs require; None (say it explicitly) serves without auth."""
    from rlhf_core.rollout.rewards import ModelReward  # heavy: torch (the scoring model); the HTTP side of this module needs none

    tokenizer = load_tokenizer(model_path)  # no pad token: pads with EOS
    model = ModelReward(model_path, tokenizer.pad_token_id)
    lock = threading.Lock()  # one forward at a time: torch threads are already parallel
    expected = token.encode() if token is not None else None

    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, body: dict, headers: dict | None = None) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802 (http.server naming)
            if self.path == "/health":  # open, for probes; what is served only with the token
                self._send(200, {"status": "ok", "auth": "none" if expected is None else "bearer",
                                 **({"model": model_path} if authorized(self.headers, expected) else {})})
            else:
                self._send(404, {"error": f"unknown path {self.path}; use POST /score or GET /health"})

        def do_POST(self):  # noqa: N802
            if self.path not in ("/score", "/get_reward"):
                return self._send(404, {"error": f"unknown path {self.path}; use POST /score or /get_reward"})
            if not authorized(self.headers, expected):
                drain(self)  # so that its client reads the 401, not a reset connection
                return self._send(401, UNAUTHORIZED, {"WWW-Authenticate": 'Bearer realm="rlhf-reward"'})
            try:
                req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                if self.path == "/get_reward":
                    req = from_openrlhf_request(req, tokenizer)
                prompts, responses = req["prompts"], req["responses"]
                if len(prompts) != len(responses) or len(prompts) > max_batch:
                    raise ValueError(f"need equal-length prompts/responses, at most {max_batch}")
                ids = req.get("token_ids") or [tokenizer(p).input_ids + tokenizer(r, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
                                               for p, r in zip(prompts, responses)]
                # where the response starts (token-level reward models pool over it): given, or
                # the length of the tokenized prompt
                plens = req.get("prompt_lens") or [len(tokenizer(p).input_ids) for p in prompts]
            except (ValueError, KeyError, TypeError) as e:
                return self._send(400, {"error": f"bad request: {e}"})
            with lock:
                values, _, _ = model([{"token_ids": x, "prompt_len": n} for x, n in zip(ids, plens)])
            self._send(200, {"rewards": values, "scores": values, "extra_logs": {}} if self.path == "/get_reward" else {"rewards": values})

        def log_message(self, fmt, *args):
            log.debug(fmt, *args)

    return ThreadingHTTPServer((host, port), Handler)


def from_openrlhf_request(req: dict, tokenizer) -> dict:
    """OpenRLHF's `{"query": [...], "prompts": [...]}` as a /score request: each query split into
    prompt and response where its prompt begins it (else all response, after an empty prompt),
    trailing EOS / pad text dropped (the scorer appends one EOS, as OpenRLHF's server does)."""
    queries = req["query"]
    prompts = req.get("prompts") or [""] * len(queries)
    if not isinstance(queries, list) or len(prompts) != len(queries):
        raise ValueError("need a list 'query' and, if given, as many 'prompts'")
    tails = [t for t in (tokenizer.eos_token, tokenizer.pad_token) if t]
    split_prompts, responses = [], []
    for q, p in zip(queries, prompts):
        while any(t and q.endswith(t) for t in tails):
            q = q[: -len(next(t for t in tails if q.endswith(t)))]
        p = p if p and q.startswith(p) else ""
        split_prompts.append(p)
        responses.append(q[len(p):])
    return {"prompts": split_prompts, "responses": responses}


def serve(model_path: str, host: str, port: int, token_file: str | Path = DEFAULT_TOKEN_FILE, auth: bool = True) -> None:
    """Serve until Ctrl-C.  `auth`: require the bearer token kept in `token_file` (made there at the
    first start, reused after); False serves anyone who can reach the port."""
    token = None
    if auth:
        token, created = secret_file(token_file, lambda: secrets.token_urlsafe(32), "reward server token file")
        path = Path(token_file).resolve()
        print(f"bearer token {'written to' if created else 'read from'} {path} (0600; never printed): clients send\n"
              f"  Authorization: Bearer <the file's content>\n  rl stage: --set rl.reward.token_file={path}", flush=True)
    else:
        log.warning("--no-auth: the reward server answers anyone who can reach %s:%d", host, port)
    server = make_server(model_path, host, port, token=token)
    if host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("reward server bound to %s: %s", host, "the bearer token travels in plain HTTP: put a TLS proxy in front"
                    if auth else "it has no authentication; do not expose it beyond a trusted network")
    log.info("serving %s at http://%s:%d/score (and OpenRLHF's /get_reward; Ctrl-C to stop)", model_path, host, server.server_address[1])
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
