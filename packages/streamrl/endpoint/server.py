"""The OpenAI-compatible endpoint of a rollout worker: `POST /v1/chat/completions` (issue 31).

One HTTP server per rollout worker, on a local port; each episode whose agent talks to it
gets its own API key (`open`), so an agent reaches its own conversation and nothing of
another episode: a request names its episode by `Authorization: Bearer <key>`, and a key
that names no open episode is refused (401). Calls of one episode share its KV cache
across turns (each call is a request of the episode's session, the engine's reuse).

A call: the body checked (`streamrl.endpoint.protocol`, 400 naming the field), its
conversation matched to the episode's tokens (`streamrl.endpoint.session`, 400
`transcript_edited` for an edited history), the turn sampled by the model service from the
held ids (with the episode's seed for that turn), kept, and answered whole or streamed.
Sampling settings are the run's: the engine samples at `rollout.temperature` and
`rollout.top_p`, so a request may leave them out or send the same values (another value
is refused, since the trainer corrects for the distribution the run samples from); a
call samples at most `rollout.max_turn_tokens` (the request's `max_tokens` may lower it).

Calls of one episode are served one at a time (a second call while one is in flight is
refused, 409: a conversation has one next turn). Model calls go through the worker's
`ModelCalls`, as the built-in runner's do: `rollout.max_model_calls` in flight at most,
`rollout.model_call_timeout_s` (past it: 504 `model_call_timeout`, the episode ends
`timeout`), spans on the episode's trace track. A request's `stop` sequences cut the
sampled turn (`streamrl.endpoint.session.stop_cut`).
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog
from aiohttp import web

from streamrl.chat.hf import HFChat
from streamrl.config import RolloutConfig
from streamrl.endpoint.protocol import (
    ApiError,
    ChatRequest,
    FinishReason,
    Reply,
    chunks,
    completion,
    parse_request,
)
from streamrl.endpoint.session import EndpointSession, TranscriptEdited, stop_cut
from streamrl.model.requests import GenRequest
from streamrl.obs.tracing import Tracer
from streamrl.rollout.episode import ModelCalls, ModelCallTimeoutError, ModelService

MODEL_NAME = "policy"  # what /v1/models lists; a request's `model` is not checked


@dataclass
class Episode:
    """An open episode: its conversation, its counters."""

    session: EndpointSession
    seed: Callable[[int], int]  # turn -> sampling seed (the built-in agent's rule)
    max_calls: int = 0  # model calls it may make (0: no limit of its own)
    track: int = 0  # its trace track (0: tracing off)
    busy: bool = False
    calls: int = 0
    limited: bool = False  # a call was refused for the call limit or a full conversation
    timed_out: bool = False  # a model call outlived rollout.model_call_timeout_s
    last_finish: str = ""  # the finish reason of its last served call
    refused: int = 0
    edited: int = 0
    model_s: float = 0.0  # seconds its served calls took, from request to result
    prefill_tokens: int = 0  # prompt positions the engine computed for them


class Endpoint:
    """The endpoint's episodes and its HTTP app (`app`, served by `start`)."""

    def __init__(
        self,
        model: ModelService,
        chat: HFChat,
        cfg: RolloutConfig,
        log: structlog.stdlib.BoundLogger,
        clock: Callable[[], float] = time.time,
        tracer: Tracer | None = None,
    ) -> None:
        self.model = model
        self.chat = chat
        self.cfg = cfg
        self.log = log
        self.clock = clock
        self.tracer = tracer or Tracer.disabled()
        self.calls = ModelCalls(model, cfg, self.tracer)
        self.episodes: dict[str, Episode] = {}
        self.app = web.Application(client_max_size=8 * 1024 * 1024)
        self.app.router.add_post("/v1/chat/completions", self._completions)
        self.app.router.add_get("/v1/models", self._models)
        self._runner: web.AppRunner | None = None
        self.host, self.port = "127.0.0.1", 0
        self._socket_dir = self.socket_path = ""

    async def start(self, host: str = "127.0.0.1", port: int = 0, unix: bool = False) -> str:
        """Serve on `host:port` (0: a free port), and with `unix` on a unix socket too
        (`socket_path`, in a directory of its own: what an agent program's sandbox binds
        in, `streamrl.endpoint.command`); the base URL an agent is given."""
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.host, self.port = host, int(self._runner.addresses[0][1])
        if unix:
            # Every local uid may connect (a root worker's sandboxed programs run as another
            # uid), as any may reach the TCP port: the episode's key is what admits a call.
            self._socket_dir = tempfile.mkdtemp(prefix="streamrl-endpoint-")
            os.chmod(self._socket_dir, 0o755)
            path = os.path.join(self._socket_dir, "endpoint.sock")
            await web.UnixSite(self._runner, path).start()
            os.chmod(path, 0o666)
            self.socket_path = path
        return self.base_url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._socket_dir:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            self._socket_dir = self.socket_path = ""

    @property
    def base_url(self) -> str:
        """What an agent's client is given (after `start`)."""
        return f"http://{self.host}:{self.port}/v1"

    def open(self, episode: str, seed: Callable[[int], int], max_calls: int = 0) -> str:
        """A new episode's API key (a secret: never logged); `max_calls` model calls at
        most (0: no limit of its own)."""
        key = f"sk-ep-{secrets.token_urlsafe(24)}"
        cfg = self.cfg
        session = EndpointSession(self.chat, episode, cfg.max_episode_tokens, cfg.max_prompt_length)
        track = self.tracer.track("episode", episode)
        self.episodes[key] = Episode(session, seed, max_calls, track)
        return key

    def close(self, key: str) -> Episode:
        """End an episode: its key stops working, its KV slot is freed; what it holds."""
        ep = self.episodes.pop(key)
        self.model.end_session(ep.session.episode)
        return ep

    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._episode(request)
        except ApiError as err:
            return _refused(err)
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "streamrl"}
                ],
            }
        )

    def _episode(self, request: web.Request) -> Episode:
        auth = request.headers.get("Authorization", "")
        key = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else ""
        ep = self.episodes.get(key) if key else None
        if ep is None:
            raise ApiError(
                "no open episode has this API key (each episode's agent gets its own)",
                status=401,
                code="invalid_api_key",
            )
        return ep

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        try:
            ep = self._episode(request)
        except ApiError as err:
            return _refused(err)
        if ep.busy:
            return _refused(
                ApiError("this episode has a call in flight: one turn at a time", status=409)
            )
        ep.busy = True
        try:
            return await self._serve(request, ep)
        except ApiError as err:
            ep.refused += 1
            if isinstance(err, TranscriptEdited):
                ep.edited += 1
            if err.code == "context_length_exceeded" and ep.session.turns:
                ep.limited = True  # the conversation is full: as the built-in agent's ends
            self.log.info(
                "endpoint_refused",
                episode=ep.session.episode,
                status=err.status,
                param=err.param,
                code=err.code,
                reason=err.message,
            )
            return _refused(err)
        finally:
            ep.busy = False

    def _check_sampling(self, req: ChatRequest) -> None:
        for name, asked, run in (
            ("temperature", req.temperature, self.cfg.temperature),
            ("top_p", req.top_p, self.cfg.top_p),
        ):
            if asked is not None and abs(asked - run) > 1e-6:
                raise ApiError(
                    f"`{name}` = {asked}: the run samples at {run} (rollout.{name}); leave it "
                    "out or send the same (the trainer corrects for the run's distribution)",
                    param=name,
                )

    async def _serve(self, request: web.Request, ep: Episode) -> web.StreamResponse:
        req = parse_request(await request.read())
        self._check_sampling(req)
        if ep.max_calls and ep.calls >= ep.max_calls:
            ep.limited = True
            raise ApiError(
                f"the episode made its {ep.max_calls} model calls (rollout.max_steps)",
                param="messages",
                code="model_call_limit",
            )
        pending = ep.session.prepare(req)
        turn_max = self.cfg.max_turn_tokens
        limit = min(req.token_limit or turn_max, turn_max, pending.room)
        turn = ep.session.turns
        gen = GenRequest(pending.prompt, limit, ep.seed(turn), session=ep.session.episode)
        t0 = time.monotonic()
        try:
            result, version = await self.calls(gen, ep.track)
        except ModelCallTimeoutError as err:
            ep.timed_out = True
            raise ApiError(str(err), status=504, code="model_call_timeout") from None
        ep.model_s += time.monotonic() - t0
        ep.prefill_tokens += result.prefill_tokens
        ids, logprobs, stopped = result.tokens, result.logprobs, result.stopped
        keep = stop_cut(self.chat, ids, req.stops)
        if keep is not None:  # a stop sequence ended the turn: the rest is dropped unseen
            ids, logprobs, stopped = ids[:keep], logprobs[:keep], True
        message = ep.session.record(
            pending, ids, logprobs, version, req.stops if keep is not None else None
        )
        ep.calls += 1
        finish: FinishReason = "tool_calls" if message.get("tool_calls") else "stop"
        if not stopped:
            finish = "length"
        ep.last_finish = finish
        rid = f"chatcmpl-{ep.session.episode}-{turn}"
        created = int(self.clock())
        reply = Reply(rid, MODEL_NAME, created, message, finish, len(pending.prompt), len(ids))
        if not req.stream:
            lps = None
            if req.logprobs:
                pairs = zip(ids, logprobs, strict=True)
                lps = [(self.chat.decode([t]), lp) for t, lp in pairs]
            return web.json_response(completion(reply, logprobs=lps))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})  # fmt: skip
        await resp.prepare(request)
        usage = bool(req.stream_options and req.stream_options.include_usage)
        for event in chunks(reply, include_usage=usage):
            await resp.write(event.encode())
        await resp.write_eof()
        return resp


def _refused(err: ApiError) -> web.Response:
    """OpenAI's error body for `err`, with its status."""
    return web.json_response(err.body(), status=err.status)
