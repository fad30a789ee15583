"""LLMEngine: one exported model, its pool, adapters and requests; `step()` runs the loop that
ort_lora/engine/__init__.py describes. Single-threaded: call every method from one thread
(AsyncEngine runs it on its own). Imports no torch.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence as SeqOf
from dataclasses import replace
from pathlib import Path

import numpy as np

from ort_lora.adapters import AdapterError, AdapterRegistry
from ort_lora.adapters.errors import CompositionError
from ort_lora.adapters.host import HostAdapter
from ort_lora.config import EngineConfig, fit_context
from ort_lora.contract import ModelManifest
from ort_lora.engine.grammar import Grammars
from ort_lora.engine.isolation import isolate, probe
from ort_lora.engine.model_runner import ModelRunner
from ort_lora.engine.pool import PagePool
from ort_lora.engine.prefix_cache import BASE_SALT, adapter_salt, composed_salt
from ort_lora.engine.request import (
    NOT_STOPPED,
    RequestLimits,
    RequestState,
    RequestTracker,
    check_request,
    completion_id,
    decorated,
)
from ort_lora.engine.sampler import sample
from ort_lora.engine.scheduler import Scheduler
from ort_lora.engine.sequence import Sequence
from ort_lora.engine.stats import engine_stats
from ort_lora.engine.step_plan import ScheduledSeq, StepPlan
from ort_lora.errors import internal_error, logger
from ort_lora.lora_request import LoRARequest
from ort_lora.outputs import RequestOutput
from ort_lora.runtime.session import ModelSession
from ort_lora.sampling_params import SamplingParams
from ort_lora.timing import StepTimes
from ort_lora.tokenizer import Tokenizer

# consecutive failed steps (the model itself fails: see _isolate) that make the engine unhealthy
MAX_STEP_FAILURES = 3


class LLMEngine:
    """One exported model, its paged pool, adapters and requests."""

    def __init__(
        self,
        model_dir: str | Path,
        config: EngineConfig | None = None,
        *,
        adapter_root: str | Path | None = None,
        intra_op_num_threads: int | None = None,
        seed: int | None = None,
        device: str = "cpu",
        **config_overrides,
    ):
        self.model_dir = Path(model_dir)
        self.manifest = ModelManifest.load(self.model_dir)
        given = config or EngineConfig(**config_overrides)
        config = fit_context(given.resolved(self.manifest), given.max_model_len is not None)
        if config.prefetch_adapters is None:  # copies overlap with steps only on a GPU
            config = replace(config, prefetch_adapters=device == "cuda")
        self.config = config
        self.num_pages, self.max_model_len = config.num_pages, config.max_model_len
        self.limits = RequestLimits(
            self.manifest.vocab_size, config.max_model_len, config.block_size, config.num_pages
        )
        self.pool = PagePool(self.num_pages)
        self.scheduler = Scheduler(config, self.pool)
        self.registry = AdapterRegistry(self.manifest, config.max_cpu_loras, adapter_root)
        self.tracker = RequestTracker(self.scheduler, self.registry)
        session = ModelSession(
            self.model_dir, self.num_pages, intra_op_num_threads, device, config.base_graph
        )
        self.runner = ModelRunner(session, self.registry)
        self.tokenizer = Tokenizer.from_model_dir(self.model_dir)
        self.eos_token_ids = list(self.manifest.eos_token_ids)
        self.rng = np.random.default_rng(seed)
        self.times = StepTimes()  # of the last step
        self.grammars = Grammars(
            self.tokenizer.backend.to_str, self.manifest.vocab_size, self.eos_token_ids
        )
        self.step_failures = 0  # consecutive steps whose model (or bookkeeping) failed

    # ---- adapters ---------------------------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest, adapter: HostAdapter | None = None) -> None:
        """Register an adapter; AdapterError names the problem. adapter: its files already
        read (registry.load), so that reading them need not hold up the engine.
        config.preload_adapters: copied into free pool pages now, so that its first request
        finds it resident (idle there: KV blocks and other adapters take the pages back)."""
        host = self.registry.register(lora_request, adapter)
        aid = lora_request.lora_int_id
        if self.config.preload_adapters and not self.pool.is_resident(aid):
            pages = self.pool.prefetch_adapter(aid, self.registry.num_pages_needed(aid))
            if pages is not None:  # else the free list is short: loaded on first use
                self.runner.load_adapter(aid, pages, adapter=host)

    def remove_lora(self, name_or_id: str | int) -> None:
        """Unload an adapter: new requests for it fail at once; running ones finish first."""
        drained = self.registry.unload(name_or_id)
        if drained is not None:
            self.tracker.drop_adapter(drained)

    def list_loras(self) -> list[LoRARequest]:
        return self.registry.requests()

    # ---- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        lora_request: LoRARequest | SeqOf[LoRARequest] | None = None,
        register: bool = True,
        grammar=None,
    ) -> RequestState:
        """Queue a request; RequestError / AdapterError (ValueError) when it cannot be served.
        lora_request: one adapter, or a list of them: a composition (each LoRARequest's
        weight; CompositionError naming what is wrong with it). register: an adapter not
        registered yet is registered now (the offline API); False: it must be registered (a
        server's adapters: unloading one is final). grammar: the structured output compiled
        beforehand (Grammars.compile, off this thread), else compiled here."""
        params = params or SamplingParams()
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenizer.encode(prompt) if text is not None else [int(t) for t in prompt]
        lora, aid, composition = self._adapters(lora_request, register)
        pages = self.registry.num_pages_needed(aid) if aid is not None else 0
        all_pages = pages + sum(n for _, n, _ in composition)
        max_tokens = check_request(ids, params, all_pages, self.limits)
        prompt_lp = params.prompt_logprobs is not None  # computed once, by completion 0
        salt = self._cache_salt(aid, composition)
        seqs = [
            Sequence(completion_id(request_id, i), ids, max_tokens, aid, pages, params, lp,
                     composition, salt)
            for i, lp in enumerate([prompt_lp] + [False] * (params.n - 1))
        ]  # fmt: skip
        constraints = self.grammars.constraints_for(params.structured_outputs, grammar)
        state = RequestState.create(
            request_id, text, ids, params, lora, seqs, self.tokenizer, constraints
        )
        self.tracker.add(state)
        return state

    def _adapters(self, lora_request, register: bool):
        """(what the output names: a LoRARequest, a tuple of them or None; the one adapter's id
        or None; a composition ((id, pages, weight), ...) or ()). One adapter at weight 1, or
        a list of just that, is that adapter alone (a DoRA adapter may be)."""
        if lora_request is None:
            return None, None, ()
        asked = [lora_request] if isinstance(lora_request, LoRARequest) else list(lora_request)
        bad = [r for r in asked if not isinstance(r, LoRARequest)]
        if bad:
            raise CompositionError(f"a composition lists LoRARequests, got {bad[0]!r}")
        loras = [self.registry.resolve(r, register) for r in asked]
        if len(asked) == 1 and asked[0].weight == 1.0:
            return loras[0], loras[0].lora_int_id, ()
        terms = self.registry.composition(
            [(r.lora_name, r.weight) for r in asked], self.config.max_loras
        )
        named = tuple(replace(lora, weight=w) for lora, (_, w) in zip(loras, terms))
        return named, None, tuple((a, self.registry.num_pages_needed(a), w) for a, w in terms)

    def _cache_salt(self, aid: int | None, composition) -> bytes | None:
        """What names the request's KV in the prefix cache beside its tokens: the content of
        its adapters (engine/prefix_cache.py); None when prefix caching is off."""
        if not self.config.enable_prefix_caching:
            return None
        if composition:
            return composed_salt([(self.registry.digest(a), w) for a, _, w in composition])
        return BASE_SALT if aid is None else adapter_salt(self.registry.digest(aid))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Cancel a request; its pages are free at once. Returns its final output."""
        return self.tracker.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.tracker)

    def take_failures(self) -> list[tuple[str, Exception]]:
        """(request id, error) of requests ended by an error since the last call: an adapter
        that could not be loaded, a fault in the step or in their own output (AsyncEngine
        and LLM raise these for them)."""
        return self.tracker.take_failures()

    # ---- one step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One turn of the loop (ort_lora/engine/__init__.py); the outputs of the requests
        that advanced or finished. A fault fails the requests it concerns, not the engine:
        a failed model run is isolated (engine/isolation.py) and the other entries go on."""
        plan = self._schedule()
        try:
            if plan.is_empty or not self._load_adapters(plan):
                return []
            masks = self._start_masks(plan)  # grammar masks fill while ORT runs the graph
            try:
                logits = self.runner.run(plan, self.times)  # [plan.num_logit_rows, vocab]
            except Exception as exc:
                survivors = self._isolate(plan, exc)
                if survivors is None:
                    return []
                plan, logits = survivors
            sampled = self._sample(plan, logits, masks)
            return self._postprocess(plan, logits, sampled)
        except Exception as exc:  # a bug around the run: every request of the plan fails
            return self._fail_step(plan, exc)

    def _schedule(self) -> StepPlan:
        times = StepTimes()
        with times.phase("schedule"):
            plan = self.scheduler.schedule()
        times.num_tokens, times.num_seqs = plan.num_tokens, len(plan.entries)
        self.times = times
        return plan

    def _load_adapters(self, plan: StepPlan) -> bool:
        """Copy the plan's adapters in. If one fails (its files changed on disk since it was
        registered), its requests end with the error and the plan is not run: the scheduler
        plans the others again next step (their pages stay allocated)."""
        with self.times.phase("load"):
            failed = self.runner.load_adapters(plan)
            for aid, error in failed.items():
                name = self.registry.request(aid).lora_name
                error = AdapterError(f"adapter {name!r} could not be loaded: {error}")
                self.tracker.fail_adapter(aid, error)
        return not failed

    def _start_masks(self, plan: StepPlan):
        """Grammar masks of the plan's constrained sampled rows (engine/grammar.py)."""
        with self.times.phase("grammar"):
            owners = [
                (e.completion_id, self.tracker.owner(e.completion_id).completion)
                for e in plan.entries
                if e.sample
            ]
            constraints = {cid: c.constraint for cid, c in owners if c.constraint}
            return self.grammars.start_masks(constraints)

    def _sample(self, plan: StepPlan, logits: np.ndarray, masks=None) -> dict[str, tuple]:
        """{completion id: (token, logprobs entry, raw logprob)} of the plan's sampled rows.
        Should the batch fail, each row is sampled alone and only the faulty requests fail."""
        with self.times.phase("sample"):
            entries = [e for e in plan.entries if e.sample]
            rows = [self.tracker.owner(e.completion_id).completion.sample_row() for e in entries]
        if masks is not None:
            with self.times.phase("grammar"):  # the wait for the masks, and setting them
                masks.apply([e.completion_id for e in entries], rows)
        with self.times.phase("sample"):
            try:
                out = sample(_rows(logits, [e.sample_row for e in entries]), rows, self.rng)
                return {e.completion_id: out.row(i) for i, e in enumerate(entries)}
            except Exception:
                return self._sample_each(entries, rows, logits)

    def _sample_each(self, entries: list[ScheduledSeq], rows: list, logits) -> dict[str, tuple]:
        out = {}
        for e, row in zip(entries, rows):
            if self.tracker.find(e.completion_id) is None:
                continue  # its request already failed (another of its completions)
            try:
                out[e.completion_id] = sample(logits[e.sample_row][None], [row], self.rng).row(0)
            except Exception as exc:
                self.tracker.fail_all([e.completion_id], exc, "sampling")
        return out

    def _postprocess(self, plan: StepPlan, logits: np.ndarray, sampled: dict[str, tuple]):
        """Prompt logprobs and new tokens into their requests (a fault fails that request
        alone), the scheduler's advance, the finish path; the outputs of the requests touched."""
        with self.times.phase("postprocess"):
            touched: dict[str, RequestState] = {}
            tokens, stopped = {}, {}
            for e in plan.entries:
                owner = self.tracker.find(e.completion_id)
                if owner is None:
                    continue  # its request failed during this step
                try:
                    self._add_results(e, owner.completion, logits, sampled, tokens, stopped)
                    touched[owner.request.request_id] = owner.request
                except Exception as exc:
                    touched.pop(owner.request.request_id, None)
                    self.tracker.fail_all([e.completion_id], exc, "its output")
            live = {c: t for c, t in tokens.items() if self.tracker.find(c) is not None}
            stopped = {c: r for c, r in stopped.items() if c in live}
            self.tracker.finish(self.scheduler.on_step_done(plan, live, stopped))
            self.step_failures = 0
            return [state.output() for state in touched.values()]

    def _add_results(self, e: ScheduledSeq, c, logits, sampled, tokens, stopped) -> None:
        """The entry's prompt logprobs, then its sampled token (with logprobs) through the
        stop rules: into `tokens` and, if it ends the completion, `stopped`."""
        if e.num_prompt_logit_rows:
            rows = logits[e.logits_offset : e.logits_offset + e.num_prompt_logit_rows]  # [k, V]
            positions = [e.start_pos + r for r in e.logit_rows[: e.num_prompt_logit_rows]]
            self.tracker.owner(e.completion_id).request.add_prompt_logprobs(
                rows, positions, self.tokenizer
            )
        if not e.sample:
            return
        token, lp, sampled_lp = sampled[e.completion_id]
        if c.logprobs is not None:
            c.logprobs.append(decorated(lp, self.tokenizer))
            c.cumulative_logprob += sampled_lp
        reason = c.add_token(token, self.eos_token_ids)
        tokens[e.completion_id] = token
        if reason is not NOT_STOPPED:
            stopped[e.completion_id] = reason

    def _isolate(self, plan: StepPlan, exc: Exception) -> tuple[StepPlan, np.ndarray] | None:
        """The model run of `plan` raised: fail the requests whose entries fail alone; the
        plan of the others and their logits, None if none is left. A failed step (towards
        MAX_STEP_FAILURES) only when no entry runs alone and neither does the probe step."""
        logger.warning("a step of %d entries failed (%s); isolating", len(plan.entries), exc)
        run = functools.partial(self.runner.run, times=self.times)
        found = isolate(run, plan, exc)
        for cid, error in found.failed.items():
            self.tracker.fail_all([cid], error, f"the model run of {cid} (it fails alone)")
        model_runs = bool(found.pieces) or self._probe(run)
        self.step_failures = 0 if model_runs else self.step_failures + 1
        return found.survivors(lambda cid: self.tracker.find(cid) is not None)

    def _probe(self, run) -> bool:
        """True if a minimal base-model step runs (engine/isolation.py: probe)."""
        error = probe(run, self.pool, self.runner.block_size)
        if error is not None:
            internal_error(error, "the probe step (every entry of a failed step failed alone)")
        return error is None

    def _fail_step(self, plan: StepPlan, exc: Exception) -> list[RequestOutput]:
        """A fault around the model run (a bug in the step's bookkeeping): every request in
        the plan ends with one logged error; MAX_STEP_FAILURES in a row make the engine
        unhealthy (AsyncEngine then answers everything 503)."""
        self.step_failures += 1
        self.tracker.fail_all([e.completion_id for e in plan.entries], exc, "engine step")
        return []

    @property
    def healthy(self) -> bool:
        return self.step_failures < MAX_STEP_FAILURES

    def close(self) -> None:
        """Release the model session (on CUDA: the device pool, streams and staging too)."""
        self.runner.session.close()

    # ---- introspection ----------------------------------------------------------------------

    def stats(self) -> dict:
        """Counts for /metrics (engine/stats.py)."""
        return engine_stats(self.scheduler, self.pool, self.registry, self.times)


def _rows(logits: np.ndarray, rows: list[int]) -> np.ndarray:
    """logits[rows] without a copy when rows are 0..n-1 in order (every decode step)."""
    if rows == list(range(len(rows))):
        return logits[: len(rows)]
    return logits[rows]
