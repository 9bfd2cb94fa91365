"""The `hf` inference engine: transformers on CPU, fp32, continuous batching, prefix KV cache.

One engine thread owns the model and does all torch work; the asyncio side only queues work
and awaits futures, so an event loop driving the engine stays responsive. Each loop
iteration runs the queued commands (abort, pause, weight load), admits waiting requests
(prefill, one at a time, reusing the longest cached prefix), then decodes one token for every
running row in a single batched forward (`kv_batch.BatchKV`). A request that arrives while
others run joins the batch at the next step.

Invariants:
- Commands run between steps, never inside one: a weight load never mixes two versions in
  one forward, and an abort returns exactly the tokens sampled so far with their logprobs.
- Every result carries `policy_version`, the version of the weights that sampled its tokens.
  A weight update aborts everything in flight first, so one result never spans two versions.
- While paused, queued requests wait; `pause()` aborts what was in flight when it was called.
- The prefix cache is cleared with every weight update (its KV belongs to the old weights).
- Token ids in a result include the stop token (eos or one of `stop_token_ids`) that ended
  it; `stop_reason` is that id for `stop_token_ids`, None for eos (vLLM's convention).
- A request with `routed=True` (MoE models only; `router_tap`) gets the experts every position
  it fed was routed to, from position 0: a prefix-cache hit gives the cached tokens' routing,
  stored with their KV; forwards that no running request wants routing of keep none.
- A vision-language model (a config with `vision_config`) takes `images` with a prompt: they
  are prefilled with it, and its prefix-cache key names each image by its hash, never by its
  placeholder tokens alone (`images.py`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from schemas.media import ImageRef
from workers.llm.contract import SamplingParams
from workers.llm.engines.exceptions import BackendError, EngineClosedError, InvalidRequestError
from workers.llm.engines.hf.config import EngineStats, HFEngineConfig
from workers.llm.engines.hf.images import ImageInputs
from workers.llm.engines.hf.kv_batch import BatchKV, cache_kwarg, single_cache
from workers.llm.engines.hf.prefix_cache import KV, PrefixCache
from workers.llm.engines.hf.router_tap import RouterTap, capture
from workers.llm.engines.hf.sampling import sample_batch
from workers.llm.engines.hf.sequence import EngineSequence, GenerationResult
from workers.llm.policy import load_model, plain_image_tokens
from workers.weights import load as weights

__all__ = ["EngineStats", "GenerationResult", "HFEngine", "HFEngineConfig"]

logger = logging.getLogger("rollout.llm.replica.hf_engine")


class HFEngine:
    """Continuous-batching generation over a transformers causal LM; see the module docstring."""

    def __init__(
        self,
        model_dir: str | Path,
        config: HFEngineConfig | None = None,
        version: int = 0,
        *,
        model: torch.nn.Module | None = None,
    ) -> None:
        """`model`: serve this live model object instead of loading `model_dir`'s weights (a
        lending trainer's own policy, `workers.trainer.lend`): not copied, and its training
        flags are left alone (the engine thread runs under inference mode); its owner must keep
        the engine paused and idle while it changes the weights."""
        from transformers import GenerationConfig

        self.config = config or HFEngineConfig()
        self.model_dir = str(model_dir)
        torch.set_num_threads(self.config.threads)
        if model is None:
            dtype = getattr(torch, self.config.dtype)
            loaded = load_model(self.model_dir, dtype=dtype, attn_implementation="sdpa")
            model = loaded.eval().requires_grad_(False)
        self.model = model
        self.images = (
            ImageInputs(self.model_dir, model.config)
            if hasattr(model.config, "vision_config")
            else None
        )
        cfg = model.config.get_text_config()
        self.vocab_size = int(cfg.vocab_size)
        self.max_model_len = self.config.max_model_len or int(cfg.max_position_embeddings)
        self._eos = set(_as_list(cfg.eos_token_id))
        try:
            self._eos |= set(
                _as_list(GenerationConfig.from_pretrained(self.model_dir).eos_token_id)
            )
        except OSError:
            pass
        heads = int(cfg.num_key_value_heads or cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self._geometry = (int(cfg.num_hidden_layers), heads, head_dim)
        self._dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        self._batch = BatchKV(*self._geometry)
        self._cache_kw = cache_kwarg(self.model)
        self._rows: list[EngineSequence] = []
        self._prefilling = 0  # admitted, not yet in `_rows` nor delivered
        self._prefix = PrefixCache(self.config.prefix_cache_tokens)
        self._targets = weights.targets(self.model)
        self.router_tap = RouterTap.attach(self.model)  # None: a dense model
        self.version = version
        self.stats = EngineStats()
        self._cv = threading.Condition()
        self._waiting: deque[EngineSequence] = deque()
        self._commands: list[tuple[Callable[[], object], concurrent.futures.Future[object]]] = []
        self._order = itertools.count()
        self._paused = False
        self._closed = False
        self._control: asyncio.Lock | None = None
        self._thread = threading.Thread(target=self._run, name="hf-engine", daemon=True)
        self._thread.start()

    # ---- asyncio side -------------------------------------------------------------------

    @property
    def is_paused(self) -> bool:
        return self._paused

    @property
    def running(self) -> int:
        """Sequences in the batch, and those taken from the queue whose prefill runs now
        (in neither list meanwhile: a long prompt must not look like an idle replica)."""
        return len(self._rows) + self._prefilling

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def validate(self, prompt: Sequence[int], params: SamplingParams, routed: bool = False) -> None:
        """Raise InvalidRequestError for a request this engine cannot serve."""
        if routed and self.router_tap is None:
            raise InvalidRequestError(
                "return_routed_experts: this model is dense (no Mixture-of-Experts layer), so "
                "it routes no token; ask for routing only from a MoE model"
            )
        if not prompt:
            raise InvalidRequestError("prompt is empty")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise InvalidRequestError(f"prompt token ids must lie in [0, {self.vocab_size})")
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"context of {self.max_model_len} tokens"
            )

    async def generate(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        routed: bool = False,
        images: Sequence[ImageRef] = (),
    ) -> GenerationResult:
        """Generate for one prompt; returns when it stops, hits a limit or is aborted.
        `routed`: also return the routed experts of every position fed (MoE models).
        `images`: the prompt's images, bytes inline (vision-language models, `images.py`)."""
        self.validate(prompt, params, routed)
        if images and self.images is None:
            raise InvalidRequestError(
                f"images: {len(images)} given, but {self.model_dir} is a text-only model"
            )
        prepared = self.images.prepare(prompt, images) if self.images is not None else None
        loop = asyncio.get_running_loop()
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        seq = EngineSequence(
            request_id=request_id or f"req-{secrets.token_hex(8)}",
            prompt=list(prompt),
            params=params,
            loop=loop,
            future=loop.create_future(),
            generator=torch.Generator().manual_seed(seed),
            order=0,
            routing=[] if routed else None,
            key=prepared.key if prepared is not None else list(prompt),
            images=prepared if prepared is not None and images else None,
        )
        with self._cv:
            if self._closed:
                raise EngineClosedError("engine is closed")
            seq.order = next(self._order)
            self._waiting.append(seq)
            self._cv.notify()
        try:
            return await seq.future
        except asyncio.CancelledError:
            self._submit(lambda: self._abort_where(lambda s: s is seq))
            raise

    async def abort(self, request_ids: Sequence[str]) -> list[str]:
        """Abort these requests (running or queued); returns the ids that were in flight."""
        wanted = set(request_ids)
        found = await self._call(lambda: self._abort_where(lambda s: s.request_id in wanted))
        return sorted({s.request_id for s in found})

    async def pause(self) -> None:
        """Abort everything in flight now; requests that come later wait for `resume()`."""
        async with self._control_lock():
            with self._cv:
                self._paused = True
                cutoff = next(self._order)
            await self._call(lambda: self._abort_where(lambda s: s.order < cutoff))

    async def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify()

    async def update_weights(self, path: str | Path, version: int) -> dict[str, float]:
        """Load a checkpoint directory into the live model and serve it as `version`.

        The checkpoint is read and checked before anything is interrupted; a bad one raises
        WeightLoadError and leaves weights and version untouched. Then everything in flight is
        aborted, the weights are copied between two steps, the prefix cache is dropped, and
        generation resumes (unless the engine was paused before, then it stays paused).
        Returns the seconds spent reading (`read_s`, generation going on) and paused (`pause_s`).
        """
        return await self.load_weights(lambda live: weights.read_checkpoint(path, live), version)

    async def load_weights(
        self, read: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]], version: int
    ) -> dict[str, float]:
        """`update_weights` from any source: `read(live tensors)` returns the checked state
        (in a thread while generation goes on: a checkpoint read, or a transfer received)."""
        async with self._control_lock():
            started = time.monotonic()
            state = await asyncio.to_thread(read, self._targets)
            read_s = time.monotonic() - started
            with self._cv:
                was_paused, self._paused = self._paused, True
                cutoff = next(self._order)
            paused = time.monotonic()

            def apply() -> None:
                self._abort_where(lambda s: s.order < cutoff)
                weights.copy_into(self._targets, state)
                self._prefix.clear()
                self.version = version

            try:
                await self._call(apply)
            finally:
                with self._cv:
                    self._paused = was_paused
                    self._cv.notify()
            pause_s = time.monotonic() - paused
            logger.info("weights version=%d (read %.2fs, paused %.3fs)", version, read_s, pause_s)
            return {"read_s": read_s, "pause_s": pause_s}

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        """Stop the engine thread; whatever is in flight ends with finish_reason 'abort'."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _control_lock(self) -> asyncio.Lock:
        if self._control is None:
            self._control = asyncio.Lock()
        return self._control

    def _submit(self, fn: Callable[[], object]) -> concurrent.futures.Future[object]:
        fut: concurrent.futures.Future[object] = concurrent.futures.Future()
        with self._cv:
            if self._closed:
                fut.set_exception(EngineClosedError("engine is closed"))
                return fut
            self._commands.append((fn, fut))
            self._cv.notify()
        return fut

    async def _call(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(self._submit(fn))

    # ---- engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        torch.set_num_threads(self.config.threads)
        with torch.inference_mode():
            self._warmup()
            while True:
                with self._cv:
                    while not (
                        self._closed
                        or self._commands
                        or self._rows
                        or (self._waiting and not self._paused)
                    ):
                        self._cv.wait()
                    if self._closed:
                        break
                    commands, self._commands = self._commands, []
                for fn, fut in commands:
                    if not fut.set_running_or_notify_cancel():
                        continue  # its caller gave up first (a request that timed out): skip it
                    try:
                        result = fn()
                    except Exception as exc:  # reported to the caller, who raises it
                        fut.set_exception(exc)
                    else:
                        fut.set_result(result)
                try:
                    self._admit()
                    if self._rows:
                        self._decode()
                except Exception as exc:
                    logger.exception("engine step failed; failing %d running", len(self._rows))
                    self._fail_running(BackendError(f"engine step failed: {exc!r}"))
            self._abort_where(lambda s: True)
            for _fn, fut in self._commands:
                fut.set_exception(EngineClosedError("engine is closed"))
        logger.info("engine thread stopped")

    def _warmup(self) -> None:
        cache = single_cache(None, *self._geometry, new=8, dtype=self._dtype)
        self.model(input_ids=torch.zeros((1, 4), dtype=torch.long), **{self._cache_kw: cache})

    def _admit(self) -> None:
        with self._cv:
            if self._paused:
                return
            room = self.config.max_batch - len(self._rows)
            admitted = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
            self._prefilling = len(admitted)
        joined: list[EngineSequence] = []
        kvs: list[KV] = []
        try:
            for seq in admitted:
                try:
                    kv = self._prefill(seq)
                except Exception as exc:  # fails this request only; the others go on
                    logger.exception("prefill of %s failed", seq.request_id)
                    self._prefilling -= 1
                    seq.deliver(BackendError(repr(exc)))
                    continue
                if seq.finish is not None:
                    self._prefix.insert(seq.key, kv, seq.routed())
                    self._prefilling -= 1  # uncounted before its answer is written
                    seq.deliver()
                else:
                    joined.append(seq)
                    kvs.append(kv)
            if joined:
                self._rows.extend(joined)  # first: if add() fails, they fail with the rest
                self._batch.add(kvs)
        finally:
            self._prefilling = 0

    def _prefill(self, seq: EngineSequence) -> KV:
        """Run the prompt past its longest cached prefix and sample the first token."""
        seq.version = self.version
        n = len(seq.prompt)
        routed = seq.routing is not None
        reuse, prefix, cached_routing = self._prefix.lookup(seq.key, limit=n - 1, routed=routed)
        extra: dict[str, Any] = {}
        if seq.images is not None:  # reuse whole images only, feed the images after it
            reuse, prefix, extra = seq.images.feed(reuse, prefix)
        self.stats.prefix_cache_queries += n
        self.stats.prefix_cache_hits += reuse
        seq.cached_tokens = reuse
        cache = single_cache(prefix, *self._geometry, new=n - reuse + 1, dtype=self._dtype)
        ids = torch.tensor([seq.prompt[reuse:]])
        plain = seq.images.plain(ids, reuse) if extra else torch.zeros_like(ids, dtype=torch.bool)
        with capture(self.router_tap, routed), plain_image_tokens(self.model, ids, plain) as ids:
            out = self.model(
                input_ids=ids,
                attention_mask=torch.ones((1, n), dtype=torch.long),
                position_ids=torch.arange(reuse, n)[None, :],
                **{self._cache_kw: cache},
                **extra,
                logits_to_keep=1,
            )
        if seq.routing is not None and self.router_tap is not None:
            seq.routing += [r for r in (cached_routing, self.router_tap.take()) if r is not None]
        self._append_rows([seq], out.logits[:, -1].float())
        return [(layer.keys, layer.values) for layer in cache.layers]

    def _decode(self) -> None:
        mask, positions = self._batch.step_inputs()
        inputs = torch.tensor([[s.out[-1]] for s in self._rows])
        routed = [i for i, s in enumerate(self._rows) if s.routing is not None]
        with capture(self.router_tap, bool(routed)):
            out = self.model(
                input_ids=inputs,
                attention_mask=mask,
                position_ids=positions,
                **{self._cache_kw: self._batch.cache()},
                logits_to_keep=1,
            )
        if routed and self.router_tap is not None:
            step = self.router_tap.take()  # row i: the token rows[i] fed (no padding is fed)
            for i in routed:
                self._rows[i].routing.append(step[i : i + 1])  # type: ignore[union-attr]
        self._batch.advanced()
        self._append_rows(self._rows, out.logits[:, -1].float())
        done = [i for i, s in enumerate(self._rows) if s.finish is not None]
        if done:
            self._retire(done)

    def _append_rows(self, rows: list[EngineSequence], logits: torch.Tensor) -> None:
        tokens, logprobs = sample_batch(
            logits, [s.params for s in rows], [s.generator for s in rows]
        )
        self.stats.generated_tokens += len(rows)
        for seq, tok, lp in zip(rows, tokens, logprobs, strict=True):
            seq.append(tok, lp, self._eos, self.max_model_len)

    def _retire(self, indices: list[int]) -> None:
        """Take these rows out of the batch, keep their KV for reuse, deliver their results.

        Delivered last: the caller's response reports `running` (the load header), which must
        no longer count the request it answers."""
        gone = set(indices)
        finished = [self._rows[i] for i in indices]
        for i, seq in zip(indices, finished, strict=True):
            self._prefix.insert(seq.key + seq.out[:-1], self._batch.row_kv(i), seq.routed())
        keep = [i for i in range(len(self._rows)) if i not in gone]
        self._batch.keep(keep)
        self._rows = [self._rows[i] for i in keep]
        for seq in finished:
            seq.deliver()

    def _abort_where(self, pred: Callable[[EngineSequence], bool]) -> list[EngineSequence]:
        """Abort matching running and queued sequences (engine thread only)."""
        with self._cv:
            queued = [s for s in self._waiting if pred(s)]
            for seq in queued:
                self._waiting.remove(seq)
        running = [i for i, s in enumerate(self._rows) if pred(s)]
        found = [self._rows[i] for i in running] + queued
        for seq in found:
            seq.finish = "abort"
            if seq in queued:
                seq.version = self.version
        if running:
            self._retire(running)
        for seq in queued:
            seq.deliver()
        return found

    def _fail_running(self, exc: BaseException) -> None:
        for seq in self._rows:
            seq.deliver(exc)
        self._rows = []
        self._batch.keep([])


def _as_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)
