"""`mdi-trace serve`: an OpenAI-compatible HTTP server over the engine, recording a trace while it serves.

    mdi-trace serve --model micro --port 8000 -o served.mdt
    curl localhost:8000/v1/completions -d '{"model": "micro", "prompt": "Hello", "max_tokens": 8}'

Starlette on uvicorn. The engine steps in its own thread (engine/async_llm.py); a request is checked here, in
the event loop, and enters the engine between two steps; its tokens come back after each step. Routes:
`/v1/completions` and `/v1/chat/completions`, each with and without `"stream": true` (server-sent events, ending
`data: [DONE]`), `/v1/models`, `/health`. Errors are the OpenAI API's: a JSON body `{"error": {"message",
"type", "param", "code"}}`, 400 for a request the engine cannot run (a prompt over the context, a token id
outside the vocabulary, an option it does not support), 404 for an unknown model or route, 503 while shutting
down; never a traceback.

A client that disconnects before its request finished cancels it, cause "disconnect": between two steps, in the
engine's safe order (`LLMEngine.abort`), so the trace shows it as a cancel. SIGINT, SIGTERM and SIGHUP stop the
server: it takes no new request; `--on-shutdown drain` (the default) lets the requests in the engine finish,
`cancel` cancels them (cause "shutdown"); a second signal cancels at once. Then the engine shuts down, the
trace's footer is written and serve exits 0.

A response's `id` names the request's seq_id in the trace: "cmpl-7" and "chatcmpl-7" are request 7. The
chat template of these byte-level checkpoints is plain text: "role: content" lines, then "assistant: ".
`--prompts-out FILE.jsonl` writes a line per request received (its prompt ids, sampling parameters and
`arrival`, seconds since the server started), the file `record --prompts` replays.
"""
from __future__ import annotations

import asyncio
import json
import signal
import socket
import sys
import threading
import time
from pathlib import Path

SHUTDOWN_MODES = ("drain", "cancel")
POLL_S = 0.25  # how often a request waiting for tokens asks whether its client is still there
DEFAULT_MAX_TOKENS = 16  # the OpenAI API's default for completions


def add_parser(sub) -> None:
    """`serve`'s options."""
    from tui.cli import _device_option, _model_option, _seed, add_engine_options

    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over the engine, recording a trace")
    _model_option(srv)
    _device_option(srv)
    srv.add_argument("--host", default="127.0.0.1", metavar="HOST", help="address to listen on")
    srv.add_argument("--port", type=_port, default=8000, metavar="N", help="port to listen on (0: any free port)")
    srv.add_argument("-o", "--output", metavar="TRACE", help="record a trace of everything served into TRACE")
    srv.add_argument("--force", action="store_true", help="replace an existing trace file (otherwise refused)")
    srv.add_argument("--prompts-out", metavar="FILE.jsonl",
                     help="write each request received (prompt ids, sampling parameters, arrival) as a line that "
                          "`record --prompts` replays")
    srv.add_argument("--served-model-name", metavar="NAME",
                     help="the model name clients give (default: --model)")
    srv.add_argument("--on-shutdown", choices=SHUTDOWN_MODES, default="drain",
                     help="on SIGINT/SIGTERM: let the requests in the engine finish, or cancel them")
    srv.add_argument("--seed", type=_seed, default=0, metavar="N",
                     help="the engine's seed: a request without its own seed samples with one derived from it")
    add_engine_options(srv)


def _port(text: str) -> int:
    from tui.cli import _whole
    return _whole(text, 0, 65536, "a port number from 0 to 65535")


# ---- errors in the OpenAI API's shape ----------------------------------------------------------------
class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self):
        from starlette.responses import JSONResponse
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# ---- what a request asks for -------------------------------------------------------------------------
class Asked:
    """A completion request, checked: its prompt's token ids, SamplingParams, stream options."""

    def __init__(self, body, tokenizer, model_name: str, chat: bool):
        from engine.sequence import SamplingParams

        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object.")
        model = body.get("model", model_name)
        if model != model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{model_name}`.",
                           param="model", code="model_not_found")
        self.chat = chat
        self.prompt_token_ids = self._chat_prompt(body, tokenizer) if chat else self._prompt(body, tokenizer)
        n = body.get("n", 1)
        if n != 1:
            raise _bad("only n=1 is supported.", "n")
        for name in ("logprobs", "top_logprobs", "echo", "best_of", "suffix", "tools", "functions"):
            if body.get(name) not in (None, False, 0, 1 if name == "best_of" else None):
                raise _bad(f"`{name}` is not supported by this server.", name)
        if body.get("top_p", 1) != 1:
            raise _bad("only top_p=1 is supported (the sampler draws from the whole distribution).", "top_p")
        if body.get("stop") not in (None, [], ""):
            raise _bad("`stop` strings are not supported; give `stop_token_ids`.", "stop")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens", DEFAULT_MAX_TOKENS))
        if max_tokens is None:
            max_tokens = DEFAULT_MAX_TOKENS
        temperature = body.get("temperature", 1.0)
        temperature = 1.0 if temperature is None else temperature
        seed, ignore_eos, stops = body.get("seed"), body.get("ignore_eos", False), body.get("stop_token_ids") or []
        _expect(_whole(max_tokens) and max_tokens >= 1, "max_tokens", "a whole number of at least 1")
        _expect(_number(temperature) and 0 <= temperature < float("inf"), "temperature", "a number of 0 or more")
        _expect(seed is None or (_whole(seed) and 0 <= seed < 1 << 63), "seed", "a whole number from 0 to 2**63 - 1")
        _expect(isinstance(ignore_eos, bool), "ignore_eos", "true or false")
        _expect(isinstance(stops, list) and all(_whole(t) for t in stops), "stop_token_ids", "a list of token ids")
        self.params = SamplingParams(temperature=float(temperature), seed=seed, max_tokens=max_tokens,
                                     ignore_eos=ignore_eos, stop_token_ids=tuple(stops))
        stream = body.get("stream", False)
        _expect(isinstance(stream, bool), "stream", "true or false")
        options = body.get("stream_options") or {}
        _expect(isinstance(options, dict), "stream_options", "an object")
        self.stream, self.include_usage = stream, bool(options.get("include_usage"))

    @staticmethod
    def _prompt(body: dict, tokenizer) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str) and prompt:
            return tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(_whole(t) for t in prompt):
            return list(prompt)
        raise _bad("`prompt` must be a non-empty string or list of token ids (one prompt per request).", "prompt")

    @staticmethod
    def _chat_prompt(body: dict, tokenizer) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("`messages` must be a non-empty list of {role, content} objects.", "messages")
        lines = []
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):  # content parts: the text ones
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
            if not isinstance(content, str) or not isinstance(m.get("role"), str):
                raise _bad("each message must be an object with a string `role` and text `content`.", "messages")
            lines.append(f"{m['role']}: {content}\n")
        return tokenizer.encode("".join(lines) + "assistant: ")


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _expect(ok: bool, name: str, what: str) -> None:
    if not ok:
        raise _bad(f"`{name}` must be {what}.", name)


# ---- the server --------------------------------------------------------------------------------------
class Server:
    """The Starlette app over an AsyncLLM: `app`, and `stop(cancel)` for the signal handler."""

    def __init__(self, llm, engine, model_name: str, prompts_out=None):
        from starlette.applications import Starlette
        from starlette.exceptions import HTTPException
        from starlette.routing import Route

        self.llm, self.engine, self.model_name, self.prompts_out = llm, engine, model_name, prompts_out
        self.created, self.t0 = int(time.time()), time.perf_counter_ns()
        self.stopping = False
        routes = [Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/health", self.health, methods=["GET"])]
        handlers = {HTTPException: self._http_error, Exception: self._server_error}
        self.app = Starlette(routes=routes, exception_handlers=handlers)

    async def _http_error(self, request, exc):
        word = {404: "no such route", 405: "method not allowed"}.get(exc.status_code, exc.detail)
        return APIError(exc.status_code, f"{request.method} {request.url.path}: {word}.",
                        code="not_found" if exc.status_code == 404 else None).response()

    async def _server_error(self, request, exc):
        return APIError(500, f"the server failed on this request ({type(exc).__name__}: {exc}).",
                        "server_error").response()

    async def health(self, request):
        from starlette.responses import JSONResponse
        if self.engine.error is not None or self.stopping:
            return JSONResponse({"status": "shutting down" if self.stopping else "engine failed"}, status_code=503)
        return JSONResponse({"status": "ok", "unfinished_requests": self.engine.num_unfinished})

    async def models(self, request):
        from starlette.responses import JSONResponse
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "mini-deepinfer",
             "max_model_len": self.llm.engine.max_model_len}]})

    async def completions(self, request):
        return await self._complete(request, chat=False)

    async def chat_completions(self, request):
        return await self._complete(request, chat=True)

    async def _complete(self, request, chat: bool):
        arrival = time.perf_counter_ns()
        try:
            try:
                body = json.loads(await request.body())
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise _bad("the request body is not valid JSON.") from None
            asked = Asked(body, self.llm.tokenizer, self.model_name, chat)
            queue, loop = asyncio.Queue(), asyncio.get_running_loop()
            try:
                stream = self.engine.submit(asked.prompt_token_ids, asked.params,
                                            lambda out: loop.call_soon_threadsafe(queue.put_nowait, out), arrival)
            except ValueError as e:
                if "shutting down" in str(e):
                    raise APIError(503, str(e), "server_error") from None
                over = len(asked.prompt_token_ids) + asked.params.max_tokens > self.llm.engine.max_model_len
                code = "context_length_exceeded" if over else None
                raise _bad(str(e), "prompt" if not chat else "messages", code) from None
        except APIError as e:
            return e.response()
        self._save(asked, arrival)
        reply = _Reply(self.llm.tokenizer, self.model_name, chat, self.created, asked)
        if asked.stream:
            from starlette.responses import StreamingResponse
            return StreamingResponse(self._events(request, stream, queue, reply), media_type="text/event-stream")
        return await self._whole(request, stream, queue, reply)

    async def _outputs(self, request, stream, queue):
        """The request's outputs as they come; its client gone (a disconnect seen, or this task cancelled
        because the client went away) cancels it in the engine."""
        finished = False
        try:
            while True:
                try:
                    out = await asyncio.wait_for(queue.get(), POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                finished = out.finish_reason is not None
                yield out
                if finished:
                    return
        finally:
            if not finished:
                stream.cancel("disconnect")

    async def _events(self, request, stream, queue, reply):
        async for out in self._outputs(request, stream, queue):
            for chunk in reply.chunks(stream.seq_id, out):
                yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    async def _whole(self, request, stream, queue, reply):
        from starlette.responses import JSONResponse
        async for out in self._outputs(request, stream, queue):
            reply.add(out)
        return JSONResponse(reply.whole(stream.seq_id))

    def _save(self, asked: Asked, arrival_ns: int) -> None:
        if self.prompts_out is None:
            return
        p = asked.params
        line = {"prompt": asked.prompt_token_ids, "max_tokens": p.max_tokens, "temperature": p.temperature,
                "seed": p.seed, "ignore_eos": p.ignore_eos, "stop_token_ids": list(p.stop_token_ids),
                "arrival": round((arrival_ns - self.t0) / 1e9, 6)}
        self.prompts_out.write(json.dumps(line) + "\n")
        self.prompts_out.flush()


class _Reply:
    """One request's response: the whole object, or its server-sent chunks, in the OpenAI API's shape."""

    def __init__(self, tokenizer, model: str, chat: bool, created: int, asked: Asked):
        self.tokenizer, self.model, self.chat, self.created, self.asked = tokenizer, model, chat, created, asked
        self.token_ids: list[int] = []
        self.text_sent = ""             # the text streamed so far (a partial UTF-8 character is held back)
        self.finish_reason: str | None = None
        self.started = False

    def add(self, out) -> str:
        """Take an output in; the new text it completes."""
        self.token_ids += out.token_ids
        self.finish_reason = out.finish_reason
        text = self.tokenizer.decode(self.token_ids)
        if out.finish_reason is None and text.endswith("\ufffd"):
            text = text[:-1]  # maybe the start of a character whose next bytes are still to come
        new, self.text_sent = text[len(self.text_sent):], text
        return new

    def _id(self, seq_id) -> str:
        return f"{'chatcmpl' if self.chat else 'cmpl'}-{seq_id}"

    def _usage(self) -> dict:
        n, m = len(self.asked.prompt_token_ids), len(self.token_ids)
        return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}

    def _finish(self):
        return self.finish_reason  # "stop", "length", or "abort" (cancelled: the server shut down)

    def chunks(self, seq_id, out) -> list[dict]:
        new = self.add(out)
        head = {"id": self._id(seq_id), "created": self.created, "model": self.model}
        chunks = []
        if self.chat:
            head["object"] = "chat.completion.chunk"
            if not self.started:
                chunks.append({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                    "finish_reason": None}]})
            if new or out.finish_reason:
                chunks.append({**head, "choices": [{"index": 0, "delta": {"content": new} if new else {},
                                                    "finish_reason": self._finish()}]})
        elif new or out.finish_reason:
            head["object"] = "text_completion"
            chunks.append({**head, "choices": [{"index": 0, "text": new, "logprobs": None,
                                                "finish_reason": self._finish()}]})
        self.started = True
        if out.finish_reason and self.asked.include_usage:
            chunks.append({**head, "choices": [], "usage": self._usage()})
        return chunks

    def whole(self, seq_id) -> dict:
        text = self.tokenizer.decode(self.token_ids)
        head = {"id": self._id(seq_id), "created": self.created, "model": self.model, "usage": self._usage()}
        if self.chat:
            return {**head, "object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": self._finish()}]}
        return {**head, "object": "text_completion", "choices": [
            {"index": 0, "text": text, "logprobs": None, "finish_reason": self._finish()}]}


# ---- the command -------------------------------------------------------------------------------------
def _uvicorn_server(config, on_signal):
    """A uvicorn.Server whose stop signals (SIGINT, SIGTERM, SIGHUP) go to `on_signal(first)` and end the run
    with exit 0: uvicorn's own handler re-raises the signal once it has shut down, which would kill serve before
    its trace's footer."""
    import uvicorn

    class _Server(uvicorn.Server):
        signals = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))

        def install_signal_handlers(self) -> None:  # uvicorn before capture_signals
            for sig in self.signals:
                signal.signal(sig, self.handle_exit)

        def capture_signals(self):
            import contextlib

            @contextlib.contextmanager
            def captured():
                previous = {sig: signal.signal(sig, self.handle_exit) for sig in self.signals}
                try:
                    yield
                finally:
                    for sig, handler in previous.items():
                        signal.signal(sig, handler)
            return captured()

        def handle_exit(self, sig, frame) -> None:
            first = not self.should_exit
            on_signal(first)
            if first:
                self.should_exit = True
            else:
                self.force_exit = True

    return _Server(config)


def serve(a, argv: list[str]) -> int:
    import uvicorn

    from engine import LLM
    from engine.async_llm import AsyncLLM
    from tracing.workload import recorded_llm
    from tui.cli import _check_device, _check_model, engine_kwargs

    _check_model(a.model)
    _check_device(a.device)
    out = Path(a.output) if a.output else None
    if out is not None and out.is_dir():
        raise SystemExit(f"mdi-trace: {out} is a folder; give -o a file name.")
    if out is not None and out.exists() and not a.force:
        raise SystemExit(f"mdi-trace: {out} exists; give another -o, or --force to replace it.")
    prompts_path = Path(a.prompts_out) if a.prompts_out else None
    if prompts_path is not None and prompts_path.exists() and not a.force:
        raise SystemExit(f"mdi-trace: {prompts_path} exists; give another --prompts-out, or --force to replace it.")
    options = dict(model=a.model, device=a.device, seed=a.seed, **engine_kwargs(a))
    sock = socket.socket(socket.AF_INET6 if ":" in a.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((a.host, a.port))
    except OSError as e:
        raise SystemExit(f"mdi-trace: cannot listen on {a.host}:{a.port}: {(e.strerror or str(e)).lower()}.") from None
    try:
        llm = recorded_llm(out, ["mdi-trace", *argv], exclusive=not a.force, **options) if out else LLM(**options)
    except ValueError as e:
        sock.close()
        raise SystemExit(f"mdi-trace: {e}") from None
    engine = AsyncLLM(llm)
    prompts_out = open(prompts_path, "w" if a.force else "x") if prompts_path else None
    name = a.served_model_name or a.model
    server = Server(llm, engine, name, prompts_out)
    cancelled = threading.Event()

    def on_signal(first: bool) -> None:
        server.stopping = True
        if a.on_shutdown == "cancel" or not first:  # a second signal: stop now
            cancelled.set()
            engine.cancel_all("shutdown")
        else:
            engine.stop_accepting()

    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    print(f"serving {name} on {url} (OpenAI API: {url}/v1/completions, {url}/v1/chat/completions)"
          f"{f'; recording {out}' if out else ''}; Ctrl-C stops it ({a.on_shutdown}).", flush=True)
    config = uvicorn.Config(server.app, log_level="warning", lifespan="off", timeout_graceful_shutdown=None,
                            access_log=False)
    try:
        _uvicorn_server(config, on_signal).run(sockets=[sock])
    finally:
        engine.shutdown(drain=not cancelled.is_set())
        if prompts_out is not None:
            prompts_out.close()
        sock.close()
    if engine.error is not None:
        print(f"mdi-trace: the engine failed ({type(engine.error).__name__}: {engine.error}); "
              f"{'the trace is in ' + str(out) if out else 'nothing was recorded'}.", file=sys.stderr)
        return 1
    print(f"stopped{f'; the trace is in {out}: mdi-trace view {out}' if out else ''}.", flush=True)
    return 0

