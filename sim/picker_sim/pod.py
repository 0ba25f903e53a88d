"""One simulated pod: a vLLM-compatible HTTP server in front of one `Engine`.

Routes: POST /v1/completions, /v1/chat/completions (SSE streaming or not), GET /v1/models,
/health, /metrics, POST /tokenize, /v1/completions/render, /v1/chat/completions/render, the
SGLang probes (/server_info, /model_info, /get_server_info, /get_model_info), and the admin API:
GET|POST /sim/fault (JSON partial update of `Faults`), POST /sim/crash ({"down_seconds": s}:
the pod stops listening, loses its cache with AllBlocksCleared, and comes back after s
seconds), GET /sim/cache (the cached block hashes), GET /sim/kv (role, engine id, pinned
blocks) and POST /sim/kv/pull (a decode pod takes pinned blocks: `kvtransfer`). Every response
carries `x-inference-pod` and `x-inference-address`.

Prefill/decode: a pod has a role (`prefill`, `decode` or `both`, llm-d's `llm-d.ai/role` label,
also SGLang's `disaggregation_mode` in /server_info); every role speaks vLLM's KV connector
protocol (`kv_transfer_params`, see `kvtransfer`), as a vLLM with NixlConnector in `kv_both`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, cast

import orjson
import zmq.asyncio
from aiohttp import HttpVersion11, web

from picker.prefix.builtin_tokenizer import Tokenizer
from picker_sim.engine import Engine, EngineConfig, EngineError, Request
from picker_sim.events import DEFAULT_TOPIC, KVEventPublisher
from picker_sim.faults import FORCE_ERROR_HEADER, Faults
from picker_sim.kvtransfer import (
    PULL_PATH,
    ROLES,
    BlockFetcher,
    KVTransferParams,
    RemotePrefill,
    block_id_list,
    parse_kv_transfer_params,
    producer_params,
)
from picker_sim.stats import render_metrics

log = logging.getLogger(__name__)

_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 429: "RateLimitError", 503: "ServiceUnavailableError"}
_SSE_DONE = b"data: [DONE]\n\n"


class HTTPError(Exception):
    """An error answered as vLLM does: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def error_response(status: int, message: str) -> web.Response:
    body = {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status, "InternalServerError"),
            "param": None,
            "code": status,
        }
    }
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


def _token_chunk(req: Request, index: int, prefix: bytes, suffix: bytes) -> bytes:
    """The SSE event carrying output token `index` of `req`."""
    word = req.output_word(index)
    return prefix + (word if index == 0 else " " + word).encode() + suffix


class _TokenWriter:
    """Writes each new token of a streaming request as one HTTP chunk, straight to the socket."""

    __slots__ = ("prefix", "suffix", "transport")

    def __init__(self, transport: asyncio.Transport, prefix: bytes, suffix: bytes) -> None:
        self.transport = transport
        self.prefix = prefix
        self.suffix = suffix

    def __call__(self, req: Request) -> None:
        if self.transport.is_closing():
            return  # client gone: the handler is cancelled and aborts the request
        data = _token_chunk(req, req.num_output - 1, self.prefix, self.suffix)
        self.transport.write(b"%x\r\n%b\r\n" % (len(data), data))


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(data), content_type="application/json")


class Pod:
    """A simulated model-server pod. Start with `await pod.start()`, stop with `await pod.stop()`."""

    def __init__(
        self,
        name: str,
        host: str,
        port: int,
        model: str,
        engine_config: EngineConfig,
        tokenizer: Tokenizer,
        zmq_ctx: zmq.asyncio.Context | None = None,
        kv_events_port: int | None = None,
        kv_replay_port: int | None = None,
        kv_events_format: str = "array",
        kv_events_connect: str | None = None,
        kv_events_topic: str = DEFAULT_TOPIC,
        lora_modules: tuple[str, ...] = (),
        faults: Faults | None = None,
        role: str = "both",
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, not {role!r}")
        self.name = name
        self.role = role
        self.engine_id = str(uuid.uuid4())  # as vLLM's, new each start of the process
        self._fetcher = BlockFetcher()
        self.host = host
        self.port = port
        self.model = model
        self.tokenizer = tokenizer
        self.lora_modules = frozenset(lora_modules)
        self.faults = faults if faults is not None else Faults()
        self.engine = Engine(engine_config)
        self._zmq_ctx = zmq_ctx
        self._kv = (kv_events_port, kv_replay_port, kv_events_format)
        self._kv_connect = kv_events_connect
        self._kv_topic = kv_events_topic
        self.publisher: KVEventPublisher | None = None
        self._runner: web.AppRunner | None = None
        self._unhung = asyncio.Event()
        self._background: set[asyncio.Task[None]] = set()
        self._headers: dict[str, str] = {}

    # -- addresses ------------------------------------------------------------------------------
    @property
    def address(self) -> str:
        """`ip:port` the pod serves HTTP on."""
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @property
    def kv_events_endpoint(self) -> str | None:
        return self.publisher.endpoint if self.publisher else None

    @property
    def kv_replay_endpoint(self) -> str | None:
        return self.publisher.replay_endpoint if self.publisher else None

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Bind the HTTP port (port 0 = pick a free one), the KV-event sockets, start the engine."""
        if not self.faults.hang:
            self._unhung.set()
        await self._listen()
        kv_port, replay_port, fmt = self._kv
        if kv_port is not None or self._kv_connect is not None:
            assert self._zmq_ctx is not None, "KV events need a zmq context"
            topic = self._kv_topic.format(ip=self.host, port=self.port, model=self.model, name=self.name)
            self.publisher = KVEventPublisher(
                self._zmq_ctx, self.host, kv_port or 0, topic, fmt, replay_port, connect=self._kv_connect
            )
            self.publisher.drop_rate = self.faults.drop_kv_events
            self.publisher.start()
            self.engine.on_events = self._publish
        self.engine.start()

    async def _listen(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        self._headers = {"x-inference-pod": self.name, "x-inference-address": self.address}
        self._runner = web.AppRunner(
            self._make_app(), access_log=None, handle_signals=False, handler_cancellation=True, shutdown_timeout=0.2
        )
        await self._runner.setup()
        await web.SockSite(self._runner, sock, backlog=1024).start()

    async def _close_http(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def stop(self) -> None:
        """Stop serving and release every socket."""
        self._unhung.set()
        for task in list(self._background):
            task.cancel()
        await self.engine.stop()
        await self._close_http()
        await self._fetcher.close()
        if self.publisher is not None:
            await self.publisher.close()

    async def crash(self) -> None:
        """Stop listening and lose all state: requests aborted, cache cleared (AllBlocksCleared)."""
        self._unhung.set()
        self.engine.reset_cache()
        await self._close_http()

    async def restart(self) -> None:
        """Listen again after `crash`, on the same address."""
        if self.faults.hang:
            self._unhung.clear()
        await self._listen()

    def _publish(self, events: list[Any]) -> None:
        assert self.publisher is not None
        self.publisher.drop_rate = self.faults.drop_kv_events
        self.publisher.publish(events)

    # -- app ------------------------------------------------------------------------------------
    def _make_app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=64 * 1024 * 1024)
        app.on_response_prepare.append(self._add_headers)
        r = app.router
        r.add_post("/v1/completions", self._completions)
        r.add_post("/v1/chat/completions", self._chat_completions)
        r.add_get("/v1/models", self._models)
        r.add_get("/health", self._health)
        r.add_get("/metrics", self._metrics)
        r.add_post("/tokenize", self._tokenize)
        r.add_post("/v1/completions/render", self._render_completions)
        r.add_post("/v1/chat/completions/render", self._render_chat)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self._server_info)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self._model_info)
        r.add_get("/sim/fault", self._get_fault)
        r.add_post("/sim/fault", self._set_fault)
        r.add_post("/sim/crash", self._crash)
        r.add_get("/sim/cache", self._cache)
        r.add_get("/sim/kv", self._kv_state)
        r.add_post(PULL_PATH, self._kv_pull)
        return app

    async def _add_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers.update(self._headers)

    @web.middleware
    async def _middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if request.path.startswith("/sim/"):
            return await handler(request)
        if not self._unhung.is_set():
            await self._unhung.wait()
        if request.method == "POST" and request.path in ("/v1/completions", "/v1/chat/completions"):
            forced = request.headers.get(FORCE_ERROR_HEADER)
            if forced is not None:
                if not forced.isdigit() or not 100 <= int(forced) <= 599:
                    return error_response(400, f"{FORCE_ERROR_HEADER} must be an HTTP status code")
                return error_response(int(forced), f"error forced by {FORCE_ERROR_HEADER}")
            if self.faults.error_rate and random.random() < self.faults.error_rate:
                return error_response(self.faults.error_status, "simulated failure")
        try:
            return await handler(request)
        except HTTPError as exc:
            return error_response(exc.status, exc.message)

    # -- request parsing ------------------------------------------------------------------------
    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as exc:
            raise HTTPError(400, f"request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise HTTPError(400, "request body must be a JSON object")
        return body

    def _resolve_model(self, name: Any) -> tuple[str, str | None]:
        """(served model name, LoRA adapter or None); 404 for unknown names."""
        if name is None or name == self.model:
            return self.model, None
        adapter = isinstance(name, str) and (name in self.lora_modules or name.startswith(f"{self.model}-lora-"))
        if adapter and self.engine.config.max_loras > 0:
            return name, name
        raise HTTPError(404, f"The model `{name}` does not exist.")

    def _prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        raise HTTPError(400, "prompt must be a string, a list of token ids, or a one-element list of either")

    def _chat_text(self, body: dict[str, Any]) -> str:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise HTTPError(400, "messages must be a non-empty list of message objects")
        return self.tokenizer.render_chat(messages)

    @staticmethod
    def _max_tokens(body: dict[str, Any], *keys: str) -> int:
        """The answer's length. The simulated model stops as soon as it may: at `min_tokens`
        when the request gives it and does not set `ignore_eos` (a client that lets the model
        end its answer, not announcing its length), else at the limit (`max_tokens`, 16 by
        default)."""
        limit = None
        for key in keys:
            value = body.get(key)
            if value is not None:
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise HTTPError(400, f"{key} must be a positive integer")
                limit = value
                break
        natural = body.get("min_tokens")
        if natural is not None and (not isinstance(natural, int) or isinstance(natural, bool) or natural < 0):
            raise HTTPError(400, "min_tokens must be a non-negative integer")
        if not natural or body.get("ignore_eos") is True:
            return limit or 16
        return natural if limit is None else min(natural, limit)

    # -- inference ------------------------------------------------------------------------------
    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        model, lora = self._resolve_model(body.get("model"))
        ids = self._prompt_ids(body.get("prompt"))
        return await self._generate(request, body, model, lora, ids, self._max_tokens(body, "max_tokens"), chat=False)

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        model, lora = self._resolve_model(body.get("model"))
        ids = self.tokenizer.encode(self._chat_text(body))
        max_tokens = self._max_tokens(body, "max_completion_tokens", "max_tokens")
        return await self._generate(request, body, model, lora, ids, max_tokens, chat=True)

    async def _generate(
        self,
        request: web.Request,
        body: dict[str, Any],
        model: str,
        lora: str | None,
        ids: list[int],
        max_tokens: int,
        chat: bool,
    ) -> web.StreamResponse:
        salt = body.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise HTTPError(400, "cache_salt must be a string")
        stream = body.get("stream") is True
        kv = self._kv_transfer_params(body)
        remote_hashes = None
        if kv is not None and kv.remote_prefill is not None:
            remote_hashes = await self._fetch_remote_blocks(kv.remote_prefill)
        producer = kv is not None and kv.do_remote_decode
        try:
            req = self.engine.submit(ids, max_tokens, lora, salt, stream, producer, remote_hashes)
        except EngineError as exc:
            raise HTTPError(400, str(exc)) from None
        try:
            if stream:
                options = body.get("stream_options")
                usage = isinstance(options, dict) and options.get("include_usage") is True
                return await self._stream(request, req, model, chat, usage)
            while req.finish_reason is None:
                await req.wait()
            if req.finish_reason == "abort":
                raise HTTPError(503, "request aborted: the engine restarted")
            return _json(self._full_response(req, model, chat))
        finally:
            self.engine.abort(req)  # no-op once finished; frees seat and blocks if the client left

    @staticmethod
    def _kv_transfer_params(body: dict[str, Any]) -> KVTransferParams | None:
        try:
            return parse_kv_transfer_params(body.get("kv_transfer_params"))
        except ValueError as exc:
            raise HTTPError(400, str(exc)) from None

    async def _fetch_remote_blocks(self, remote: RemotePrefill) -> list[int]:
        """The remote prefill's block hashes; none (a local prefill, as vLLM falls back to) when
        the remote does not have them any more."""
        if not remote.block_ids:
            return []  # a prompt shorter than a block: nothing was pinned, nothing to fetch
        hashes = await self._fetcher.fetch(remote)
        if hashes is None:
            self.engine.stats.failed_transfers += 1
            log.warning("pod %s: remote blocks from %s unavailable, prefilling locally", self.name, remote.engine_id)
            return []
        return hashes

    def _request_id(self, req: Request, chat: bool) -> str:
        return f"{'chatcmpl' if chat else 'cmpl'}-{self.name}-{req.id}"

    @staticmethod
    def _usage(req: Request) -> dict[str, Any]:
        return {
            "prompt_tokens": req.prompt_len,
            "total_tokens": req.prompt_len + req.num_output,
            "completion_tokens": req.num_output,
            "prompt_tokens_details": {"cached_tokens": max(req.num_cached, 0)},
        }

    def _full_response(self, req: Request, model: str, chat: bool) -> dict[str, Any]:
        text = req.output_text()
        if chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": req.finish_reason,
                "stop_reason": None,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": req.finish_reason,
                "stop_reason": None,
            }
        request_id = self._request_id(req, chat)
        response = {
            "id": request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
            "usage": self._usage(req),
        }
        if req.kv_producer:
            response["kv_transfer_params"] = producer_params(
                self.engine_id, req.pinned_block_ids, request_id, self.host, self.port
            )
        return response

    async def _stream(
        self, request: web.Request, req: Request, model: str, chat: bool, include_usage: bool
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        # HTTP/1.1 streams are chunked by us after the first write (see _TokenWriter); 1.0 has no chunks.
        direct = request.version >= HttpVersion11 and request.transport is not None
        if direct:
            resp.enable_chunked_encoding()
        await resp.prepare(request)
        head = {
            "id": self._request_id(req, chat),
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
        }
        # Each token chunk is `prefix + text + suffix`: JSON built once per request, not per token.
        opening = orjson.dumps(head)[:-1]
        # A chat stream opens with the assistant's role chunk, which vLLM sends with the first
        # engine output, i.e. after the prefill: sent at once, it made a router measuring TTFT to
        # the first body byte see every chat prompt answered in a few milliseconds.
        role_chunk = b""
        if chat:
            prefix = b"data: " + opening + b',"choices":[{"index":0,"delta":{"content":"'
            suffix = b'"},"logprobs":null,"finish_reason":null}]}\n\n'
            role = {
                **head,
                "choices": [
                    {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                ],
            }
            role_chunk = b"data: " + orjson.dumps(role) + b"\n\n"
        else:
            prefix = b"data: " + opening + b',"choices":[{"index":0,"text":"'
            suffix = b'","logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'
        sent = 0
        while True:
            produced = req.num_output
            # A local, not a test of req.finish_reason: that would narrow it to None in the
            # branches below, and the type checker cannot see req.wait() changing it.
            finished = req.finish_reason is not None
            if produced > sent:
                tokens = b"".join(_token_chunk(req, i, prefix, suffix) for i in range(sent, produced))
                await resp.write(role_chunk + tokens)
                role_chunk = b""
                sent = produced
            elif finished:
                break
            elif direct and sent:
                # Headers and a first chunk went out through aiohttp; from here on the step loop
                # writes each token itself. No await since the check above: no token is missed.
                req.on_token = _TokenWriter(cast(asyncio.Transport, request.transport), prefix, suffix)
                while req.finish_reason is None:
                    await req.wait()
                break
            else:
                await req.wait()
        if req.finish_reason == "abort":
            return resp  # engine restarted mid-stream: the stream just ends, without [DONE]
        delta: dict[str, object] = {"delta": {}} if chat else {"text": ""}
        last = {
            **head,
            "choices": [
                {"index": 0, **delta, "logprobs": None, "finish_reason": req.finish_reason, "stop_reason": None}
            ],
        }
        tail = role_chunk + b"data: " + orjson.dumps(last) + b"\n\n"  # the role chunk: no token came
        if include_usage:
            tail += b"data: " + orjson.dumps({**head, "choices": [], "usage": self._usage(req)}) + b"\n\n"
        await resp.write(tail + _SSE_DONE)
        await resp.write_eof()
        return resp

    # -- token endpoints ------------------------------------------------------------------------
    def _text_of(self, body: dict[str, Any]) -> str:
        if "messages" in body:
            return self._chat_text(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise HTTPError(400, "prompt must be a string (or give messages)")
        return prompt

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        text = self._text_of(body)
        ids = self.tokenizer.encode(text)
        return _json(
            {
                "count": len(ids),
                "max_model_len": self.engine.config.max_model_len,
                "tokens": ids,
                "token_strs": self.tokenizer.token_strs(text, ids),
            }
        )

    def _generate_request(self, body: dict[str, Any], model: str, ids: list[int]) -> dict[str, Any]:
        """vLLM's render answer: the GenerateRequest it would run (token ids, sampling params)."""
        return {
            "request_id": None,
            "token_ids": ids,
            "features": None,
            "model": model,
            "sampling_params": {"max_tokens": body.get("max_tokens") or body.get("max_completion_tokens")},
            "stream": body.get("stream") is True,
            "cache_salt": body.get("cache_salt"),
        }

    async def _render_completions(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        model, _ = self._resolve_model(body.get("model"))
        return _json([self._generate_request(body, model, self._prompt_ids(body.get("prompt")))])

    async def _render_chat(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        model, _ = self._resolve_model(body.get("model"))
        ids = self.tokenizer.encode(self._chat_text(body))
        return _json(self._generate_request(body, model, ids))

    # -- probes ---------------------------------------------------------------------------------
    async def _models(self, request: web.Request) -> web.Response:
        created = int(time.time())
        cfg = self.engine.config
        data = [
            {
                "id": self.model,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": self.model,
                "parent": None,
                "max_model_len": cfg.max_model_len,
            }
        ]
        for name in sorted(self.lora_modules | set(self.engine.loaded_loras)):
            data.append(
                {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": "vllm",
                    "root": name,
                    "parent": self.model,
                    "max_model_len": cfg.max_model_len,
                }
            )
        return _json({"object": "list", "data": data})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.faults.metrics_delay:
            await asyncio.sleep(self.faults.metrics_delay)  # fault: a slow scrape target
        if self.faults.metrics_garbage:
            return web.Response(text="<html>this is {not a metrics page\n", content_type="text/plain")
        page = render_metrics(self.engine, self.model)
        return web.Response(body=page.encode(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def _server_info(self, request: web.Request) -> web.Response:
        cfg = self.engine.config
        return _json(
            {
                "model_path": self.model,
                "tokenizer_path": self.tokenizer.name,
                "served_model_name": self.model,
                "context_length": cfg.max_model_len,
                "page_size": cfg.block_size,
                "max_total_num_tokens": cfg.num_gpu_blocks * cfg.block_size,
                "max_running_requests": cfg.max_num_seqs,
                "chunked_prefill_size": cfg.max_num_batched_tokens,
                "disaggregation_mode": "null" if self.role == "both" else self.role,
                "dp_size": 1,
                "tp_size": 1,
                "version": "picker-sim",
            }
        )

    async def _model_info(self, request: web.Request) -> web.Response:
        return _json({"model_path": self.model, "tokenizer_path": self.tokenizer.name, "is_generation": True})

    # -- admin ----------------------------------------------------------------------------------
    async def _get_fault(self, request: web.Request) -> web.Response:
        return _json(self.faults.as_dict())

    async def _set_fault(self, request: web.Request) -> web.Response:
        try:
            self.faults.update(await self._body(request))
        except HTTPError as exc:
            return error_response(exc.status, exc.message)
        except ValueError as exc:
            return error_response(400, str(exc))
        if self.faults.hang:
            self._unhung.clear()
        else:
            self._unhung.set()
        return _json(self.faults.as_dict())

    async def _crash(self, request: web.Request) -> web.Response:
        down = 1.0
        if request.can_read_body:
            try:
                body = await self._body(request)
            except HTTPError as exc:
                return error_response(exc.status, exc.message)
            down = body.get("down_seconds", down)
            if not isinstance(down, (int, float)) or isinstance(down, bool) or down < 0:
                return error_response(400, "down_seconds must be a non-negative number")
        task = asyncio.get_running_loop().create_task(self._crash_and_restart(float(down)))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return _json({"crashing": True, "down_seconds": down})

    async def _crash_and_restart(self, down: float) -> None:
        await asyncio.sleep(0.05)  # let the admin answer reach the client before the socket closes
        await self.crash()
        await asyncio.sleep(down)  # the simulated outage
        try:
            await self.restart()
        except OSError as exc:
            log.error("pod %s could not listen again on %s: %s", self.name, self.address, exc)

    async def _cache(self, request: web.Request) -> web.Response:
        return _json({"block_hashes": sorted(self.engine.cache.refs)})

    async def _kv_state(self, request: web.Request) -> web.Response:
        pinned = [list(p.block_ids) for p in self.engine.pinned.values()]
        return _json({"role": self.role, "engine_id": self.engine_id, "pinned_block_ids": pinned})

    async def _kv_pull(self, request: web.Request) -> web.Response:
        """A decode pod takes pinned blocks: 200 with their hashes, 404 if they are gone."""
        try:
            body = await self._body(request)
        except HTTPError as exc:
            return error_response(exc.status, exc.message)
        engine_id, block_ids = body.get("remote_engine_id"), block_id_list(body.get("remote_block_ids"))
        if block_ids is None:
            return error_response(400, "remote_block_ids must be a list of non-negative integers")
        if engine_id != self.engine_id:
            return error_response(404, f"engine {engine_id!r} is not this pod's ({self.engine_id})")
        hashes = self.engine.take_pinned(block_ids)
        if hashes is None:
            return error_response(404, "no pinned blocks with these ids (expired or taken)")
        return _json({"block_hashes": hashes})
